"""Image sizes from file headers, without decoding pixels (stdlib only).

The data profiler needs the width and height of every image of a dataset, and nothing
else: decoding millions of images would take hours, while the size sits in the first
bytes of the file. :func:`read_image_header` recognises the format from its magic bytes
(never from the file name) and parses:

======  ===================================================================================
format  where the size is
======  ===================================================================================
PNG     the ``IHDR`` chunk right after the signature (also APNG).
JPEG    the first start-of-frame marker (``SOF0``..``SOF15`` except ``DHT``/``JPG``/``DAC``,
        i.e. baseline, extended, progressive, lossless, arithmetic); the segments before
        it are skipped by their lengths, so large EXIF/ICC segments cost one seek each.
GIF     the logical screen descriptor (``GIF87a``/``GIF89a``).
BMP     the DIB header (``BITMAPCOREHEADER`` 16-bit sizes or ``BITMAPINFOHEADER`` and
        later 32-bit sizes; a negative height means top-down rows and counts as its
        absolute value).
WebP    ``RIFF``/``WEBP`` with a ``VP8 `` (lossy: the key frame header), ``VP8L`` (lossless:
        14-bit sizes) or ``VP8X`` (extended: 24-bit canvas size) first chunk.
======  ===================================================================================

EXIF orientation
----------------
JPEG files may carry an EXIF orientation tag (``0x0112``); values 5 to 8 mean the stored
image is displayed rotated by 90 degrees. LLaVA-family loaders open images with
``PIL.Image.open(path).convert("RGB")``, which does *not* apply the EXIF rotation, so the
model sees the stored size: :func:`read_image_header` therefore reports the stored size and
the orientation separately (``ImageHeader.orientation``, 1 when absent or not a JPEG), and
:func:`read_image_size` swaps width and height only when asked
(``apply_exif_orientation=True``). Orientation is read for JPEG only.

Errors are :class:`ImageHeaderError` (a ``ValueError``) naming the file and what is wrong.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO, NamedTuple, Union

from dflop.safe_io import not_regular_reason, open_regular

__all__ = [
    "FRAME_FILE_EXTENSIONS",
    "ImageHeader",
    "ImageHeaderError",
    "NotARegularFileError",
    "count_frame_files",
    "image_decode_error",
    "read_image_header",
    "read_image_size",
]

FRAME_FILE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")
"""File extensions (lower case) counted as video frames in a frames folder."""

ImageSource = Union[str, "os.PathLike[str]", BinaryIO]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# SOFn markers: C0..CF except C4 (DHT), C8 (JPG, reserved) and CC (DAC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0..RST7
_EXIF_ORIENTATION_TAG = 0x0112


class ImageHeaderError(ValueError):
    """The file is not a supported image or its header is truncated/corrupt."""


class NotARegularFileError(ImageHeaderError):
    """The path is a folder, named pipe, device or socket: refused without reading it (a
    named pipe would block ``open()`` forever)."""


class ImageHeader(NamedTuple):
    """What :func:`read_image_header` reads.

    Attributes:
        width_px: stored width in pixels.
        height_px: stored height in pixels.
        format: ``"png"``, ``"jpeg"``, ``"gif"``, ``"bmp"`` or ``"webp"``.
        orientation: EXIF orientation (1..8; 1 when absent or not a JPEG).
    """

    width_px: int
    height_px: int
    format: str
    orientation: int = 1


def read_image_size(
    source: ImageSource, *, apply_exif_orientation: bool = False
) -> tuple[int, int]:
    """``(width_px, height_px)`` of an image, from its header only.

    Args:
        source: a path or a binary file object positioned at the start of the image.
        apply_exif_orientation: swap width and height when the JPEG's EXIF orientation is
            5..8 (rotated by 90 degrees). Off by default: LLaVA-family loaders do not
            apply EXIF rotation (see the module docstring).

    Raises:
        FileNotFoundError: no such file.
        NotARegularFileError: a folder, named pipe, device or socket (never opened).
        ImageHeaderError: not a PNG/JPEG/GIF/BMP/WebP file, or a truncated/corrupt header.
            Messages name the file and the problem, never the file's bytes.
    """
    header = read_image_header(source)
    if apply_exif_orientation and header.orientation in (5, 6, 7, 8):
        return header.height_px, header.width_px
    return header.width_px, header.height_px


def read_image_header(source: ImageSource) -> ImageHeader:
    """Format, stored size and EXIF orientation of an image, from its header only.

    See :func:`read_image_size` for the arguments and errors.
    """
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        try:  # checked before opening: a named pipe would block open() forever
            f = open_regular(name, "rb", "image")
        except FileNotFoundError:
            raise
        except ValueError as exc:
            raise NotARegularFileError(str(exc)) from None
        with f:
            return _read_header(f, name)
    name = getattr(source, "name", "<file object>")
    return _read_header(source, str(name))


def count_frame_files(folder: str | os.PathLike[str]) -> int:
    """Number of image files (:data:`FRAME_FILE_EXTENSIONS`, any case) in a frames folder.

    Sub-folders and other files are ignored. Raises ``NotADirectoryError`` /
    ``FileNotFoundError`` when ``folder`` is not a directory.
    """
    with os.scandir(folder) as entries:
        return sum(
            1 for e in entries if e.name.lower().endswith(FRAME_FILE_EXTENSIONS) and e.is_file()
        )


# --------------------------------------------------------------------------- parsers


def image_decode_error(path: str | os.PathLike[str]) -> str | None:
    """Why the image at ``path`` cannot be decoded (``None`` when it can). The header is
    not enough: a file cut short or corrupted after its header has a valid size and fails
    only when its pixels are read. This decodes every compressed byte (JPEG at 1/8 scale:
    the entropy-coded data is still read in full), so it costs a fraction of a full decode.
    Needs Pillow."""
    from PIL import Image

    problem = not_regular_reason(path)
    if problem is not None:  # never opened: a named pipe would block forever
        return f"cannot decode image {os.fspath(path)!r}: it {problem}"
    try:
        with Image.open(path) as image:
            if image.format == "JPEG":
                image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        return f"cannot decode image {os.fspath(path)!r}: {exc}"
    return None


def _read_header(f: BinaryIO, name: str) -> ImageHeader:
    head = f.read(32)
    if head.startswith(_PNG_SIGNATURE):
        return _png(head, name)
    if head.startswith(b"\xff\xd8"):
        f.seek(-len(head) + 2, os.SEEK_CUR)
        return _jpeg(f, name)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return _gif(head, name)
    if head.startswith(b"BM"):
        return _bmp(head, name)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp(head, name)
    if not head:
        raise ImageHeaderError(f"{name}: empty file, not an image")
    # The file's bytes are not quoted: the file may be anything (a password file).
    raise ImageHeaderError(
        f"{name}: unrecognised image format: not a PNG, JPEG, GIF, BMP or WebP image "
        "(its header matches none of them)"
    )


def _need(head: bytes, size: int, name: str, what: str) -> None:
    if len(head) < size:
        raise ImageHeaderError(f"{name}: truncated {what} header ({len(head)} of {size} bytes)")


def _checked(width: int, height: int, name: str, fmt: str, orientation: int = 1) -> ImageHeader:
    if width < 1 or height < 1:
        raise ImageHeaderError(f"{name}: {fmt} header gives an invalid size {width}x{height}")
    return ImageHeader(int(width), int(height), fmt, orientation)


def _png(head: bytes, name: str) -> ImageHeader:
    _need(head, 24, name, "PNG")
    if head[12:16] != b"IHDR":
        raise ImageHeaderError(f"{name}: PNG without an IHDR chunk first (corrupt file)")
    width, height = struct.unpack(">II", head[16:24])
    return _checked(width, height, name, "png")


def _gif(head: bytes, name: str) -> ImageHeader:
    _need(head, 10, name, "GIF")
    width, height = struct.unpack("<HH", head[6:10])
    return _checked(width, height, name, "gif")


def _bmp(head: bytes, name: str) -> ImageHeader:
    _need(head, 18, name, "BMP")
    (dib_size,) = struct.unpack("<I", head[14:18])
    if dib_size == 12:  # BITMAPCOREHEADER (OS/2 1.x)
        _need(head, 22, name, "BMP")
        width, height = struct.unpack("<HH", head[18:22])
    elif dib_size >= 16:
        _need(head, 26, name, "BMP")
        width, height = struct.unpack("<ii", head[18:26])
        height = abs(height)
    else:
        raise ImageHeaderError(f"{name}: BMP with an invalid DIB header size {dib_size}")
    return _checked(width, height, name, "bmp")


def _webp(head: bytes, name: str) -> ImageHeader:
    _need(head, 30, name, "WebP")
    chunk = head[12:16]
    if chunk == b"VP8 ":
        if head[23:26] != b"\x9d\x01\x2a":
            raise ImageHeaderError(f"{name}: WebP VP8 chunk without the key-frame start code")
        width, height = struct.unpack("<HH", head[26:30])
        return _checked(width & 0x3FFF, height & 0x3FFF, name, "webp")
    if chunk == b"VP8L":
        if head[20] != 0x2F:
            raise ImageHeaderError(f"{name}: WebP VP8L chunk with a bad signature byte")
        (bits,) = struct.unpack("<I", head[21:25])
        return _checked((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, name, "webp")
    if chunk == b"VP8X":
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return _checked(width, height, name, "webp")
    raise ImageHeaderError(f"{name}: WebP with an unknown first chunk type (corrupt file)")


def _jpeg(f: BinaryIO, name: str) -> ImageHeader:
    """Walk the JPEG markers after SOI up to the first SOFn."""
    orientation = 1
    while True:
        byte = f.read(1)
        if not byte:
            raise ImageHeaderError(f"{name}: JPEG ends before its start-of-frame marker")
        if byte != b"\xff":
            raise ImageHeaderError(
                f"{name}: corrupt JPEG (no segment marker at byte {f.tell() - 1})"
            )
        marker = 0xFF
        while marker == 0xFF:  # fill bytes
            b = f.read(1)
            if not b:
                raise ImageHeaderError(f"{name}: JPEG ends before its start-of-frame marker")
            marker = b[0]
        if marker in _JPEG_STANDALONE or marker == 0xD8:
            continue
        if marker in (0xD9, 0xDA):
            raise ImageHeaderError(f"{name}: JPEG reaches scan data without a start-of-frame")
        raw = f.read(2)
        if len(raw) < 2:
            raise ImageHeaderError(f"{name}: truncated JPEG segment header")
        (length,) = struct.unpack(">H", raw)
        if length < 2:
            raise ImageHeaderError(f"{name}: corrupt JPEG segment length {length}")
        if marker in _JPEG_SOF:
            body = f.read(5)
            if len(body) < 5:
                raise ImageHeaderError(f"{name}: truncated JPEG start-of-frame segment")
            _, height, width = struct.unpack(">BHH", body)
            if height == 0:
                raise ImageHeaderError(
                    f"{name}: JPEG height defined by a DNL marker (not supported)"
                )
            return _checked(width, height, name, "jpeg", orientation)
        if marker == 0xE1 and orientation == 1:
            body = f.read(length - 2)
            orientation = _exif_orientation(body)
            continue
        f.seek(length - 2, os.SEEK_CUR)


def _exif_orientation(app1: bytes) -> int:
    """EXIF orientation of an APP1 segment's body; 1 when absent or unreadable."""
    if not app1.startswith(b"Exif\x00\x00"):
        return 1
    tiff = app1[6:]
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "<" if tiff[:2] == b"II" else ">"
    (ifd,) = struct.unpack(order + "I", tiff[4:8])
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack(order + "H", tiff[ifd : ifd + 2])
    for k in range(count):
        entry = tiff[ifd + 2 + 12 * k : ifd + 14 + 12 * k]
        if len(entry) < 12:
            return 1
        tag, typ = struct.unpack(order + "HH", entry[:4])
        if tag == _EXIF_ORIENTATION_TAG and typ == 3:  # SHORT
            (value,) = struct.unpack(order + "H", entry[8:10])
            return value if 1 <= value <= 8 else 1
    return 1
