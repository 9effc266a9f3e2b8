"""Integrations of the layer with training frameworks, each an optional import that needs its framework installed
(the core package imports none of them):

    mok.integrations.torchtitan   swap_moe_experts(model): torchtitan's MoE models run their experts on mok
"""
