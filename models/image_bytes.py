"""What encoded image bytes say before they are decoded: their format by its signature, the least
data a JPEG of its size can hold, and the first directory of a TIFF.

:func:`models.image.decode_image` reads these to refuse, before any pixel is decoded, a file
whose header claims more than its data can hold, and to name the real problem when a decoder
fails on bytes that only look like its format.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

#: Signatures (first bytes) of the formats a client may send, in the order they are tried.
SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "BigTIFF"),
    (b"MM\x00+", "BigTIFF"),
    (b"II\xbc\x01", "JPEG XR (Windows Media Photo)"),
    (b"BM", "BMP"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"DDS ", "DDS"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000 codestream"),
    (b"%PDF", "PDF"),
)


def sniff_format(data: bytes) -> str | None:
    """The format the bytes' signature names (``"JPEG"``, ``"TIFF"``, ``"HEIF/AVIF"``...), or None."""
    for signature, name in SIGNATURES:
        if data.startswith(signature):
            return name
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return "HEIF/AVIF"
    return None


def describe_bytes(data: bytes) -> str:
    """``"a TIFF by its signature (49 49 2A 00 ...)"``: what the first bytes say, for messages."""
    head = " ".join(f"{b:02X}" for b in data[:8]) + (" ..." if len(data) > 8 else "")
    sniffed = sniff_format(data)
    if sniffed is None:
        return f"no known image signature (it starts {head})"
    return f"a {sniffed} by its signature ({head})"


@dataclass(frozen=True)
class JpegFrame:
    """A JPEG's frame header (SOFn): coding process, size and each component's sampling."""

    marker: int  # 0xC0..0xCF: the SOF marker's second byte
    width: int
    height: int
    sampling: tuple[tuple[int, int], ...]  # (horizontal, vertical) per component

    @property
    def coding(self) -> str:
        """``sequential`` or ``progressive`` (Huffman), ``arithmetic``, ``lossless``, ``hierarchical``."""
        if self.marker in (0xC0, 0xC1):
            return "sequential"
        if self.marker == 0xC2:
            return "progressive"
        if self.marker in (0xC3, 0xC7, 0xCB, 0xCF):
            return "lossless"
        if self.marker in (0xC5, 0xC6, 0xCD, 0xCE):
            return "hierarchical"
        return "arithmetic"

    def blocks(self) -> int:
        """8x8 blocks of all components (each counted at its own sampling, without MCU padding)."""
        h_max = max(h for h, _ in self.sampling)
        v_max = max(v for _, v in self.sampling)
        total = 0
        for h, v in self.sampling:
            columns = -(-self.width * h // h_max)
            rows = -(-self.height * v // v_max)
            total += -(-columns // 8) * -(-rows // 8)
        return total

    def least_bytes(self) -> int:
        """The fewest bytes of entropy-coded data a complete image of this frame can have.

        Every Huffman code is at least 1 bit. A sequential scan codes each block's DC difference
        and an end-of-block (or 63 AC codes): at least 2 bits per block. A progressive image's
        first DC scans code each block's DC: at least 1 bit per block. Arithmetic, lossless and
        hierarchical coding give no such bound (0).
        """
        bits = {"sequential": 2, "progressive": 1}.get(self.coding, 0)
        return -(-self.blocks() * bits // 8)


#: SOF markers: 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: Markers without a length field: TEM, RSTn, SOI, EOI.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """The frame header of a JPEG (the first SOFn before the first scan), or None if there is none
    or the markers cannot be followed."""
    if not data.startswith(b"\xff\xd8"):
        return None
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker == 0xDA:  # start of scan: no frame header came before it
            return None
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if marker in _SOF_MARKERS:
            return _read_frame(data, pos + 4, marker)
        pos += 2 + length
    return None


def _read_frame(data: bytes, start: int, marker: int) -> JpegFrame | None:
    if start + 6 > len(data):
        return None
    _, height, width, count = struct.unpack_from(">BHHB", data, start)
    if count == 0 or start + 6 + 3 * count > len(data):
        return None
    sampling = []
    for i in range(count):
        factors = data[start + 6 + 3 * i + 1]
        h, v = factors >> 4, factors & 0x0F
        if h == 0 or v == 0:
            return None
        sampling.append((h, v))
    return JpegFrame(marker, width, height, tuple(sampling))


#: More entries than any TIFF image needs (baseline TIFF defines 36 tags; cameras write ~100).
MAX_TIFF_ENTRIES = 1000


def tiff_first_directory(data: bytes) -> str | None:
    """A description of a TIFF's first directory (IFD) when it cannot be what a TIFF holds, else None.

    A TIFF image needs a dozen or so tags; a directory whose entries run past the end of the file,
    or that holds thousands of entries, is corrupt or built to mislead the decoder.
    """
    if len(data) < 8 or data[:4] not in (b"II*\x00", b"MM\x00*"):
        return None
    order = "<" if data[:2] == b"II" else ">"
    (offset,) = struct.unpack_from(order + "I", data, 4)
    if offset + 2 > len(data):
        return f"its first directory starts at byte {offset:,}, past the end of the {len(data):,}-byte file"
    (entries,) = struct.unpack_from(order + "H", data, offset)
    end = offset + 2 + 12 * entries
    if end > len(data):
        return (
            f"its first directory claims {entries:,} entries ({12 * entries:,} bytes), more than the "
            f"{len(data) - offset - 2:,} bytes that follow it"
        )
    if entries > MAX_TIFF_ENTRIES:
        return f"its first directory has {entries:,} entries (an image needs a few dozen)"
    return None

