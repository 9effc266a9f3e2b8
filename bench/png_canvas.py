"""A small raster canvas that writes PNG files with the standard library alone (zlib + struct): the fallback renderer
of bench/chart_png.py and tools/timeline_png.py where matplotlib is missing (the GPU machine has no package
registry).

Canvas: an RGB image, white by default; filled rectangles, horizontal and vertical lines, and text in a built-in
5x7 bitmap font (printable ASCII; two more rows below the baseline for descenders) scaled by an integer factor.
Coordinates are pixels, x to the right and y down from the top-left corner; rectangles are half-open
[x0, x1) x [y0, y1) and clipped to the canvas.
write_png / read_png: 8-bit RGB PNGs, one IDAT chunk, filter type 0 on every row (read_png reads what write_png
writes, for tests); png_size reads the width and height of any PNG from its IHDR chunk. nice_step: axis ticks.
"""
import math
import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_COLOUR_TYPE_RGB = 2
PNG_BIT_DEPTH = 8
PNG_FILTER_NONE = 0
ZLIB_LEVEL = 6
WHITE = (255, 255, 255)
BLACK = (0, 0, 0)

GLYPH_WIDTH = 5  # font pixels; a glyph's rows are GLYPH_WIDTH characters, "#" set, "." clear
CAP_HEIGHT = 7  # rows above the baseline (capitals, digits)
GLYPH_HEIGHT = 9  # CAP_HEIGHT plus two descender rows (g, j, p, q, y, comma, semicolon)
ADVANCE = GLYPH_WIDTH + 1  # one clear column between glyphs
LINE_HEIGHT = GLYPH_HEIGHT + 1

# Each glyph: CAP_HEIGHT rows, or GLYPH_HEIGHT rows for those with descenders, space-separated.
_GLYPHS = {
    " ": "..... ..... ..... ..... ..... ..... .....",
    "!": "..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..",
    '"': ".#.#. .#.#. ..... ..... ..... ..... .....",
    "#": ".#.#. .#.#. ##### .#.#. ##### .#.#. .#.#.",
    "$": "..#.. .#### #.#.. .###. ..#.# ####. ..#..",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "&": ".##.. #..#. #.#.. .#... #.#.# #..#. .##.#",
    "'": "..#.. ..#.. .#... ..... ..... ..... .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "*": "..... ..#.. #.#.# .###. #.#.# ..#.. .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    ",": "..... ..... ..... ..... ..... .##.. .##.. ..#.. .#...",
    "-": "..... ..... ..... .###. ..... ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    "/": "....# ....# ...#. ..#.. .#... #.... #....",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    ";": "..... .##.. .##.. ..... .##.. .##.. ..#.. .#... .....",
    "<": "...#. ..#.. .#... #.... .#... ..#.. ...#.",
    "=": "..... ..... ##### ..... ##### ..... .....",
    ">": ".#... ..#.. ...#. ....# ...#. ..#.. .#...",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
    "@": ".###. #...# #.### #.#.# #.### #.... .####",
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "[": ".###. .#... .#... .#... .#... .#... .###.",
    "\\": "#.... #.... .#... ..#.. ...#. ....# ....#",
    "]": ".###. ...#. ...#. ...#. ...#. ...#. .###.",
    "^": "..#.. .#.#. #...# ..... ..... ..... .....",
    "_": "..... ..... ..... ..... ..... ..... #####",
    "`": ".#... ..#.. ..... ..... ..... ..... .....",
    "a": "..... ..... .###. ....# .#### #...# .####",
    "b": "#.... #.... #.##. ##..# #...# #...# ####.",
    "c": "..... ..... .###. #.... #.... #...# .###.",
    "d": "....# ....# .##.# #..## #...# #...# .####",
    "e": "..... ..... .###. #...# ##### #.... .###.",
    "f": "..##. .#..# .#... ###.. .#... .#... .#...",
    "g": "..... ..... .#### #...# #...# #...# .#### ....# .###.",
    "h": "#.... #.... #.##. ##..# #...# #...# #...#",
    "i": "..#.. ..... .##.. ..#.. ..#.. ..#.. .###.",
    "j": "...#. ..... ..##. ...#. ...#. ...#. ...#. #..#. .##..",
    "k": "#.... #.... #..#. #.#.. ##... #.#.. #..#.",
    "l": ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "m": "..... ..... ##.#. #.#.# #.#.# #.#.# #.#.#",
    "n": "..... ..... #.##. ##..# #...# #...# #...#",
    "o": "..... ..... .###. #...# #...# #...# .###.",
    "p": "..... ..... ####. #...# #...# #...# ####. #.... #....",
    "q": "..... ..... .#### #...# #...# #...# .#### ....# ....#",
    "r": "..... ..... #.##. ##..# #.... #.... #....",
    "s": "..... ..... .###. #.... .###. ....# ####.",
    "t": ".#... .#... ###.. .#... .#... .#..# ..##.",
    "u": "..... ..... #...# #...# #...# #..## .##.#",
    "v": "..... ..... #...# #...# #...# .#.#. ..#..",
    "w": "..... ..... #...# #...# #.#.# #.#.# .#.#.",
    "x": "..... ..... #...# .#.#. ..#.. .#.#. #...#",
    "y": "..... ..... #...# #...# #...# #...# .#### ....# .###.",
    "z": "..... ..... ##### ...#. ..#.. .#... #####",
    "{": "...#. ..#.. ..#.. .#... ..#.. ..#.. ...#.",
    "|": "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "}": ".#... ..#.. ..#.. ...#. ..#.. ..#.. .#...",
    "~": "..... ..... .#... #.#.# ...#. ..... .....",
}
UNKNOWN_GLYPH = "?"  # drawn for characters the font does not have


def _glyph_pixels(rows):
    """(column, row) of a glyph's set pixels."""
    return tuple((col, row) for row, line in enumerate(rows.split()) for col, c in enumerate(line) if c == "#")


FONT = {c: _glyph_pixels(rows) for c, rows in _GLYPHS.items()}


def nice_step(extent, target_intervals):
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) giving at most target_intervals over extent > 0."""
    magnitude = 10 ** math.floor(math.log10(extent / target_intervals))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if extent / (m * magnitude) <= target_intervals)


def parse_colour(colour):
    """(r, g, b) of "#rrggbb" or of an (r, g, b) tuple."""
    if isinstance(colour, str):
        if len(colour) != 7 or colour[0] != "#":
            raise ValueError(f"colour {colour!r}: expected #rrggbb")
        return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return tuple(colour)


def text_width(text, scale=1):
    """Pixels from the first glyph's left edge to the last one's right edge."""
    return max(0, len(text) * ADVANCE - 1) * scale


def fit_scale(text, max_width, largest, smallest=1):
    """The largest font scale from largest down to smallest at which text fits max_width pixels (smallest if none)."""
    return next((s for s in range(largest, smallest, -1) if text_width(text, s) <= max_width), smallest)


def text_height(scale=1):
    """Pixels of a line's capitals (descenders hang below)."""
    return CAP_HEIGHT * scale


class Canvas:
    """An RGB image in a bytearray, 3 bytes a pixel, row after row."""

    def __init__(self, width, height, background=WHITE):
        if width <= 0 or height <= 0:
            raise ValueError(f"canvas {width}x{height}: both sides must be positive")
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(parse_colour(background)) * (width * height))

    def fill_rect(self, x0, y0, x1, y1, colour):
        """[x0, x1) x [y0, y1), clipped; coordinates are rounded to pixels."""
        x0, x1 = max(0, round(x0)), min(self.width, round(x1))
        y0, y1 = max(0, round(y0)), min(self.height, round(y1))
        if x0 >= x1 or y0 >= y1:
            return
        span = bytes(parse_colour(colour)) * (x1 - x0)
        for y in range(y0, y1):
            begin = 3 * (y * self.width + x0)
            self.pixels[begin:begin + len(span)] = span

    def hline(self, x0, x1, y, colour, thickness=1):
        self.fill_rect(x0, y, x1, y + thickness, colour)

    def vline(self, x, y0, y1, colour, thickness=1):
        self.fill_rect(x, y0, x + thickness, y1, colour)

    def outline_rect(self, x0, y0, x1, y1, colour):
        self.hline(x0, x1, y0, colour)
        self.hline(x0, x1, y1 - 1, colour)
        self.vline(x0, y0, y1, colour)
        self.vline(x1 - 1, y0, y1, colour)

    def pixel(self, x, y):
        begin = 3 * (y * self.width + x)
        return tuple(self.pixels[begin:begin + 3])

    def text(self, x, y, text, colour=BLACK, scale=1, align="left"):
        """Draws text with its capitals' top at y; align: x is the text's left edge, centre or right edge."""
        width = text_width(text, scale)
        x = round({"left": x, "centre": x - width / 2, "right": x - width}[align])
        y = round(y)
        for i, c in enumerate(text):
            left = x + i * ADVANCE * scale
            for col, row in FONT.get(c, FONT[UNKNOWN_GLYPH]):
                self.fill_rect(left + col * scale, y + row * scale, left + (col + 1) * scale, y + (row + 1) * scale,
                               colour)

    def png_bytes(self):
        return encode_png(self.width, self.height, self.pixels)

    def save(self, path):
        with open(path, "wb") as f:
            f.write(self.png_bytes())


def _chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(width, height, rgb):
    """PNG file bytes of width x height RGB pixels (3 bytes each, row after row)."""
    stride = 3 * width
    if len(rgb) != stride * height:
        raise ValueError(f"{len(rgb)} bytes of pixels for a {width}x{height} RGB image")
    raw = b"".join(bytes([PNG_FILTER_NONE]) + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, PNG_BIT_DEPTH, PNG_COLOUR_TYPE_RGB, 0, 0, 0)
    return (PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, ZLIB_LEVEL))
            + _chunk(b"IEND", b""))


def _chunks(data):
    """(kind, payload) of each chunk of PNG file bytes, CRCs checked."""
    if data[:len(PNG_SIGNATURE)] != PNG_SIGNATURE:
        raise ValueError("not a PNG file (bad signature)")
    at = len(PNG_SIGNATURE)
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, payload = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        if len(payload) != length or crc != zlib.crc32(kind + payload):
            raise ValueError(f"PNG chunk {kind!r} at byte {at}: truncated or bad CRC")
        yield kind, payload
        at += 12 + length


def png_size(path):
    """(width, height) from a PNG's IHDR chunk (any PNG)."""
    with open(path, "rb") as f:
        data = f.read()
    kind, payload = next(_chunks(data))
    if kind != b"IHDR":
        raise ValueError(f"{path}: the first chunk is {kind!r}, not IHDR")
    return struct.unpack(">II", payload[:8])


def read_png(path):
    """(width, height, RGB bytes) of a PNG as encode_png writes it (8-bit RGB, no interlace, filter 0 rows)."""
    with open(path, "rb") as f:
        chunks = list(_chunks(f.read()))
    header = dict(chunks)[b"IHDR"]
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if (depth, colour_type, interlace) != (PNG_BIT_DEPTH, PNG_COLOUR_TYPE_RGB, 0):
        raise ValueError(f"{path}: bit depth {depth}, colour type {colour_type}, interlace {interlace}: only "
                         f"8-bit RGB without interlace is read")
    raw = zlib.decompress(b"".join(payload for kind, payload in chunks if kind == b"IDAT"))
    stride = 3 * width
    if len(raw) != (stride + 1) * height:
        raise ValueError(f"{path}: {len(raw)} bytes of image data for {width}x{height}")
    rows = []
    for y in range(height):
        row = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        if row[0] != PNG_FILTER_NONE:
            raise ValueError(f"{path}: row {y} has filter type {row[0]}; only filter 0 rows are read")
        rows.append(row[1:])
    return width, height, b"".join(rows)
