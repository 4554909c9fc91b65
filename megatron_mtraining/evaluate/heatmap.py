"""The needle heat map, as the papers draw it: context length on x, needle depth on y (0 at the
top), colour the share of trials retrieved, from red (0) through yellow to green (1).

With matplotlib importable it draws labels, the cell values and a colour bar. Without it the PNG is
written here (``write_png``: 8-bit RGB, zlib), each cell a block of pixels and no text; the cells
are in the order of ``needle.json`` (lengths ascending left to right, depths top to bottom).
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import List, Optional, Sequence, Tuple

__all__ = ["colour", "format_length", "write_heatmap", "write_png"]

_STOPS = ((0.0, (215, 48, 39)), (0.5, (254, 224, 99)), (1.0, (26, 152, 80)))  # red, yellow, green
MISSING = (160, 160, 160)


def colour(value: float) -> Tuple[int, int, int]:
    """RGB of ``value`` in [0, 1] on the red-yellow-green map (grey for NaN)."""
    if value is None or math.isnan(value):
        return MISSING
    value = min(1.0, max(0.0, float(value)))
    for (a, ca), (b, cb) in zip(_STOPS[:-1], _STOPS[1:]):
        if value <= b:
            t = (value - a) / (b - a)
            return tuple(round(x + t * (y - x)) for x, y in zip(ca, cb))
    return _STOPS[-1][1]


def write_png(path: str, pixels: Sequence[Sequence[Tuple[int, int, int]]]) -> None:
    """Write rows of RGB pixels (all rows of one width) as an 8-bit RGB PNG."""
    height, width = len(pixels), len(pixels[0]) if pixels else 0
    if not height or not width or any(len(row) != width for row in pixels):
        raise ValueError("write_png takes a non-empty rectangle of pixels")
    raw = b"".join(b"\x00" + bytes(c for pixel in row for c in pixel) for row in pixels)  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, RGB, deflate, no filter, no interlace
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def format_length(tokens: int) -> str:
    """4096 -> "4K", 1048576 -> "1M", 1500 -> "1500"."""
    for size, suffix in ((1024 ** 2, "M"), (1024, "K")):
        if tokens % size == 0:
            return f"{tokens // size}{suffix}"
    return str(tokens)


def write_heatmap(path: str, accuracy: Sequence[Sequence[float]], lengths: Sequence[int], depths: Sequence[float],
                  title: str = "Needle in a haystack", use_matplotlib: Optional[bool] = None, cell: int = 32) -> str:
    """``accuracy[i][j]``: depth ``depths[i]``, length ``lengths[j]``. ``use_matplotlib``: None
    uses it where importable. Returns "matplotlib" or "png" (the writer used)."""
    if len(accuracy) != len(depths) or any(len(row) != len(lengths) for row in accuracy):
        raise ValueError(f"accuracy must be [depths={len(depths)}][lengths={len(lengths)}]")
    if use_matplotlib is None:
        try:
            import matplotlib  # noqa: F401
            use_matplotlib = True
        except ImportError:
            use_matplotlib = False
    if use_matplotlib:
        _matplotlib_heatmap(path, accuracy, lengths, depths, title)
        return "matplotlib"
    pixels: List[List[Tuple[int, int, int]]] = []
    for row in accuracy:
        line = [colour(value) for value in row for _ in range(cell)]
        pixels += [line] * cell
    write_png(path, pixels)
    return "png"


def _matplotlib_heatmap(path, accuracy, lengths, depths, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("needle", [(a, [c / 255 for c in rgb]) for a, rgb in _STOPS])
    cmap.set_bad([c / 255 for c in MISSING])  # cells not evaluated
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    image = ax.imshow(accuracy, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    for i, row in enumerate(accuracy):
        for j, value in enumerate(row):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
