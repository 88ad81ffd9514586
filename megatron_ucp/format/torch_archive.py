"""Whether a torch zip file has exactly the form ``torch.save`` writes, judged without torch.

A universal folder must hold no file ``torch.load`` rejects. Files our writer wrote are
byte-identical to ``torch.save``'s by test; the files a conversion copies as they are (model states,
pipeline layer files) are judged here instead of by torch's own zip reader, whose import costs a
small conversion its whole run (about 2 s of CPU and 160 MB). The check is a whitelist, not a list
of known damage: a file passes only in the form ``torch.save`` produces (one archive folder, stored
records each where its directory entry says, the zip64 trailer torch writes, a ``version`` record of
a format torch reads, nothing after the trailer), and a fuzz test holds it to torch's reader (every
file it passes, torch opens). Anything else, which a tolerant reader might still read, is handed to
torch's reader (:class:`~megatron_ucp.format.torchload.TorchReaderCheck`).
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Optional

from megatron_ucp.format.paths import open_checkpoint_file

KNOWN_FORMAT_VERSIONS = (1, 2, 3)
"""``version`` record values ``torch.save`` has written (every torch reads them)."""
_ALLOWED_FLAGS = 0x0808
"""Data descriptor (bit 3) and UTF-8 names (bit 11): what torch's writer sets; never encryption."""
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64_LOCATOR = struct.Struct("<IIQI")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")


def unproven(path: os.PathLike | str) -> Optional[str]:
    """None when ``path`` has ``torch.save``'s form throughout; else the first way it differs (then torch's
    own reader must judge it). Reads the trailer, the directory, the local headers and the tiny
    ``version`` record only."""
    from megatron_ucp.format.torchload import structure_problems

    problems = structure_problems(path)
    if problems:
        return problems[0]
    with open_checkpoint_file(path) as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        if os.pread(fd, 4, 0) != b"PK\x03\x04":
            return "does not start with a zip record"
        trailer, directory = _trailer(fd, size)
        if trailer:
            return trailer
        listed, why = _directory(fd, *directory)
        if why:
            return why
        try:
            z = zipfile.ZipFile(fh)
        except Exception as exc:  # what zipfile cannot parse, torch must judge
            return f"an unreadable zip directory ({type(exc).__name__})"
        with z:
            infos = z.infolist()
            if [i.orig_filename for i in infos] != listed:
                return "the directory's names read otherwise by zipfile"
            if not infos or "/" not in infos[0].filename:
                return "no archive folder"
            prefix = infos[0].filename.split("/", 1)[0] + "/"
            names = [i.filename for i in infos]
            if len(set(names)) != len(names):
                return "a record name appears twice"
            for info in infos:
                if info.orig_filename != info.filename:  # zipfile cuts a name at a NUL byte; miniz does not
                    return f"{info.filename}: a name zipfile had to clean up ({info.orig_filename!r})"
                if not info.filename.startswith(prefix) or info.compress_type != zipfile.ZIP_STORED:
                    return f"{info.filename}: not a stored record of {prefix}"
                if info.flag_bits & ~_ALLOWED_FLAGS:
                    return f"{info.filename}: flags {info.flag_bits:#x}"
                if info.volume != 0:
                    return f"{info.filename}: on disk {info.volume} of a multi-disk archive"
                if (info.external_attr, info.internal_attr, info.comment) != (0, 0, b""):
                    return f"{info.filename}: file attributes or a comment torch's writer does not set"
            version = next((prefix + v for v in (".data/version", "version") if prefix + v in names), None)
            if version is None:
                return "no version record"
            try:
                value = int(z.read(version).decode("ascii").strip())  # zipfile checks the CRC-32
            except Exception as exc:
                return f"{version}: unreadable ({exc})"
            if value not in KNOWN_FORMAT_VERSIONS:
                return f"{version}: format version {value}"
    return None


_CDH = struct.Struct("<IHHHHHHIIIHHHHHII")


def _directory(fd: int, offset: int, size: int, entries: int) -> tuple[list[str], Optional[str]]:
    """The central directory walked entry by entry as miniz does: (the names, what is wrong or None).
    Each entry's lengths must keep it inside the directory, which they must fill exactly."""
    data = os.pread(fd, size, offset)
    names, at = [], 0
    while at < len(data):
        if len(data) - at < _CDH.size:
            return names, "a directory entry cut short"
        fields = _CDH.unpack_from(data, at)
        if fields[0] != 0x02014B50:
            return names, f"no directory entry signature at byte {offset + at}"
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        end = at + _CDH.size + name_len + extra_len + comment_len
        if end > len(data):
            return names, "a directory entry runs past the directory"
        try:
            names.append(data[at + _CDH.size : at + _CDH.size + name_len].decode("utf-8"))
        except UnicodeDecodeError:
            return names, "a record name that is not UTF-8"
        at = end
    if len(names) != entries:
        return names, f"{len(names)} directory entries, the trailer says {entries}"
    return names, None


def _trailer(fd: int, size: int) -> tuple[Optional[str], tuple[int, int, int]]:
    """(what is wrong with the trailer, or None; the directory's offset, size and entries). The end
    of the file is the end-of-central-directory record (no comment, nothing after it), preceded, where
    torch's writer puts them, by the zip64 record (of its standard size) and its locator, which agree
    with it; the central directory ends where the trailer begins."""
    if size < _EOCD.size:
        return "shorter than a zip trailer", (0, 0, 0)
    sig, disk, cd_disk, n_here, n_total, cd_size, cd_offset, comment = _EOCD.unpack(
        os.pread(fd, _EOCD.size, size - _EOCD.size)
    )
    if sig != 0x06054B50 or comment != 0 or disk != 0 or cd_disk != 0 or n_here != n_total:
        return "the file does not end with a plain end-of-central-directory record", (0, 0, 0)
    at = size - _EOCD.size - _EOCD64_LOCATOR.size
    locator = _EOCD64_LOCATOR.unpack(os.pread(fd, _EOCD64_LOCATOR.size, at)) if at >= 0 else (0, 0, 0, 0)
    if locator[0] != 0x07064B50:
        ends = cd_offset + cd_size == size - _EOCD.size
        return (None if ends else "the directory does not end at the trailer"), (cd_offset, cd_size, n_total)
    _, _, eocd64_at, disks = locator
    if disks != 1 or eocd64_at + _EOCD64.size != at:
        return "a zip64 locator that does not point at the record before it", (0, 0, 0)
    sig64, record_size, _, _, disk64, cd_disk64, here64, total64, cd_size64, cd_offset64 = _EOCD64.unpack(
        os.pread(fd, _EOCD64.size, eocd64_at)
    )
    if sig64 != 0x06064B50 or record_size != _EOCD64.size - 12 or disk64 or cd_disk64 or here64 != total64:
        return "a zip64 end-of-central-directory record torch's writer would not write", (0, 0, 0)
    if (n_total != 0xFFFF and n_total != total64) or (cd_offset != 0xFFFFFFFF and cd_offset != cd_offset64):
        return "the zip64 and the plain trailer disagree", (0, 0, 0)
    if cd_offset64 + cd_size64 != eocd64_at:
        return "the directory does not end where the zip64 trailer begins", (0, 0, 0)
    return None, (cd_offset64, cd_size64, total64)


def directory_digest(path: os.PathLike | str) -> Optional[str]:
    """SHA-256 of the file's zip directory and trailer (every record's name, size and CRC-32, as the writer computed
    them from the bytes it wrote): with each record's bytes checked against its CRC-32, it covers every byte of the
    file. None when the file does not end as a torch zip does. Reads the end of the file only."""
    import hashlib

    with open_checkpoint_file(path) as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        why, (offset, _, _) = _trailer(fd, size)
        if why is not None or offset >= size:
            return None
        return hashlib.sha256(os.pread(fd, size - offset, offset)).hexdigest()
