"""What every command that writes does to hold its output: ``tokenize --out``, ``export --hf``
and ``train --out`` share these rules.

[Note: a command holds its output]
- **One writer at a time.** A command holds an exclusive ``flock`` on its output for as
  long as it writes it: ``train`` on its ``--out`` folder (``rundir.OutLock``), ``tokenize``
  and ``export`` on a hidden lock file beside their output (``OutputLock``:
  ``.NAME.lock``, removed when released). A second live command on the same output is
  refused at once, naming the process that holds it; the kernel drops the lock of a
  killed one, so a crash never leaves the output locked.
- **Whole or nothing.** What a command writes goes first to a hidden name beside the
  output, unique to its process (``checkpoint.files.staging_path``: ``.NAME.PID.KIND``),
  and is renamed into place once complete. Two commands never share a temporary file,
  and a killed one leaves only a hidden file.
- **No temporary file is ever input.** The readers of a folder (``train --data DIR``,
  ``tokenize DIR``) skip hidden names, so neither a command's own temporaries nor a
  killed command's leftovers are read as documents.
- **Nothing a user owns is an output.** An output equal to an input, or inside a folder
  that is an input, is refused before anything is written (``check_not_input``): a
  folder input would otherwise take the output in as a document the next time it is read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
from pathlib import Path

__all__ = ["OutputLock", "check_not_input"]


def _inside(path: Path, folder: Path) -> bool:
    return folder == path or folder in path.parents


def check_not_input(out: str | os.PathLike, inputs, *, who: str, flag: str = "--out") -> None:
    """Refuse an output that is one of ``inputs`` or lies inside one of them (a folder).

    Args:
        out: the output path (it need not exist).
        inputs: ``(flag, path)`` pairs: the inputs, named as the command line names them.
        who: the command, for the message.
        flag: the output's option. Default ``"--out"``.

    Raises:
        ValueError: naming both arguments and the fix.
    """
    target = Path(out).resolve()
    for name, path in inputs:
        if path is None:
            continue
        source = Path(path)
        same = target.exists() and source.exists() and os.path.samefile(target, source)
        if same or target == source.resolve():
            raise ValueError(
                f"{who}: {flag} '{out}' is the input {name} '{path}' itself: writing it would "
                f"destroy the input; pass another {flag}"
            )
        if source.is_dir() and _inside(target, source.resolve()):
            raise ValueError(
                f"{who}: {flag} '{out}' is inside the input folder {name} '{path}': the next "
                f"read of that folder would take it in as a document; pass a {flag} outside it"
            )


class OutputLock:
    """An exclusive ``flock`` on an output file or folder for the time a command writes it,
    held on the hidden lock file ``.NAME.lock`` beside it (the output itself may not
    exist yet). See [Note: a command holds its output].

    Args:
        path: the output.
        who: the command, for the message.
        flag: the output's option (``--out``, ``--hf``).

    Raises (``acquire``):
        ValueError: another live process holds it (named by its pid).
    """

    def __init__(self, path: str | os.PathLike, *, who: str, flag: str = "--out"):
        self.path = Path(path)
        self.lock_path = self.path.with_name(f".{self.path.name}.lock")
        self.who, self.flag = who, flag
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise ValueError(
                    f"{self.who}: cannot write beside {self.flag} '{self.path}' "
                    f"({err.strerror or err}: '{self.lock_path}'); pass a {self.flag} in a "
                    "folder you can write"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise ValueError(
                        f"{self.who}: another live process (pid {holder}) is writing {self.flag} "
                        f"'{self.path}'; wait for it to end, or pass another {self.flag}"
                    ) from None
                print(
                    f"{self.who}: warning: '{self.lock_path}' cannot be locked "
                    f"({err.strerror or err}): a second process writing {self.flag} at the same "
                    "time would not be detected",
                    file=sys.stderr,
                )
                return
            # The holder before us may have removed the file we opened: lock the one there now.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.lock_path)  # while held: the next holder re-checks the file
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
