"""Remove a directory tree that a tool may have made hostile: iteratively, in bounded memory,
in slices of bounded time. Stdlib only (the reaper loads this file by path).

What a tool can leave in its scratch directory, and what this does about it:

* nesting of any depth: no recursion; at most :data:`MAX_DEPTH` directories are held open at
  once, and a subtree deeper than that is first moved up to the top of the tree (a rename
  within the tree), so neither memory nor open descriptors grow with depth;
* millions of entries: a directory is read as a stream, a batch of at most :data:`BATCH`
  subdirectory names at a time; memory does not grow with the number of entries;
* names that are not UTF-8: names stay the bytes they are (``surrogateescape``);
* links: every operation is relative to an open directory and never follows a symbolic link
  (``O_NOFOLLOW``, ``unlinkat``); a hard link to an outside file only loses its name here;
* mounts: a directory is entered with ``openat2(RESOLVE_NO_XDEV)``, so no mount point is ever
  crossed (bind mounts of the same filesystem included); where ``openat2`` is missing, a
  directory on another device is not entered. A mount point is left in place and reported;
* modes: a directory its own mode makes unreadable, unsearchable or unwritable is given back
  ``0700`` (its contents are going anyway); a file's own mode never matters to ``unlink``;
* sockets, FIFOs and device nodes are unlinked, never opened;
* immutable or append-only flags (which a root tool can set) are cleared where the remover may,
  on directories and on files that have no other name;
* a tree that changes under the walk: a vanished entry is skipped, a directory that became a
  file is unlinked, a file that became a directory is entered, a directory that reappears is
  walked again; an entry that cannot be removed is skipped (and reported) instead of retried
  without end, and after :data:`MAX_SKIPPED` of them the removal gives up.

:class:`Removal` works in slices: :meth:`Removal.step` returns after at most a deadline, so a
caller (the reaper's loop) can serve others between slices. :func:`remove_tree` runs one to
the end or to a timeout.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import sys
import time
from dataclasses import dataclass, field

__all__ = ("BATCH", "MAX_DEPTH", "MAX_SKIPPED", "Removal", "remove_tree")

#: Directories held open at once; a deeper subtree is moved up to the top first.
MAX_DEPTH = 32
#: Subdirectory names read from a directory before they are walked (then it is read again).
BATCH = 64
#: Entries that could not be removed before the removal gives up.
MAX_SKIPPED = 10_000
#: Error messages kept (the rest are counted).
MAX_ERRORS = 10
#: Attempts to remove a directory that keeps filling up again.
_MAX_RETRIES = 3

_SYS_OPENAT2 = 437 if platform.machine() in ("x86_64", "aarch64") else None
_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_IMMUTABLE_FL = 0x10
_FS_APPEND_FL = 0x20


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


_openat2_missing = _SYS_OPENAT2 is None


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _open_dir(parent: int, name: str, flags: int = _DIR_FLAGS) -> int:
    """Open the directory ``name`` of ``parent`` without following a link or crossing a
    mount. Raises OSError (EXDEV for a mount point)."""
    global _openat2_missing
    if not _openat2_missing:
        how = _OpenHow(flags, 0, _RESOLVE_NO_XDEV | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
        fd = int(
            _libc().syscall(
                _SYS_OPENAT2, parent, os.fsencode(name), ctypes.byref(how), ctypes.sizeof(how)
            )
        )
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EPERM) or (err == errno.EPERM and _probe_openat2()):
            raise OSError(err, os.strerror(err), name)
        _openat2_missing = True  # an old kernel, or a seccomp filter that refuses it
    return os.open(name, flags, dir_fd=parent)


def _probe_openat2() -> bool:
    """Whether openat2 works at all here (an EPERM may come from a seccomp filter)."""
    how = _OpenHow(_DIR_FLAGS, 0, 0)
    fd = int(_libc().syscall(_SYS_OPENAT2, -100, b"/", ctypes.byref(how), ctypes.sizeof(how)))
    if fd >= 0:
        os.close(fd)
        return True
    return False


def _clear_flags(fd: int) -> bool:
    """Clear the immutable and append-only flags of the open file ``fd``; True if it had any."""
    import fcntl

    buf = bytearray(8)
    try:
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
        flags = int.from_bytes(buf[:4], sys.byteorder)
        if not flags & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
            return False
        flags &= ~(_FS_IMMUTABLE_FL | _FS_APPEND_FL)
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags.to_bytes(4, sys.byteorder) + bytes(4))
    except OSError:
        return False
    return True


@dataclass
class _Frame:
    fd: int
    name: str  # its name in the parent frame's directory ('' for the top)
    batch: list[str] = field(default_factory=list)  # subdirectories to walk next
    skipped: set[str] = field(default_factory=set)  # entries that cannot be removed
    retries: dict[str, int] = field(default_factory=dict)  # rmdir ENOTEMPTY per name
    fixed: bool = False  # its flags were cleared once already


class Removal:
    """The removal of one tree, done in slices (:meth:`step`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.removed = 0  # entries removed
        self.skipped = 0  # entries left in place (see errors)
        self.errors: list[str] = []
        self.error_count = 0
        self.done = False
        self.gave_up = False
        self._stack: list[_Frame] = []
        self._dev: int | None = None
        self._started = False
        self._moved = 0  # subtrees moved up to the top
        self._euid = os.geteuid()

    # ---- reporting

    @property
    def finished(self) -> bool:
        """Done, and the tree is gone."""
        return self.done and not os.path.lexists(self.path)

    def summary(self) -> str:
        if not self.done:
            return f"{self.path}: {self.removed} entries removed so far, still removing"
        if self.finished:
            return f"{self.path}: removed ({self.removed} entries)"
        more = f" (and {self.error_count - len(self.errors)} more)" if self._more_errors else ""
        why = "; ".join(self.errors) + more if self.errors else "unknown"
        return f"{self.path}: {self.skipped} entries could not be removed: {why}"

    @property
    def _more_errors(self) -> bool:
        return self.error_count > len(self.errors)

    def _error(self, what: str, exc: OSError | str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS:
            detail = exc if isinstance(exc, str) else errno.errorcode.get(exc.errno or 0, str(exc))
            self.errors.append(f"{what}: {detail}")

    def _skip(self, frame: _Frame, name: str, exc: OSError | str) -> None:
        frame.skipped.add(name)
        self.skipped += 1
        self._error(repr(os.fsencode(name))[1:], exc)
        if self.skipped >= MAX_SKIPPED:
            self.gave_up = True
            self._error("gave up", f"{MAX_SKIPPED} entries could not be removed")

    # ---- the walk

    def step(self, deadline: float | None = None) -> bool:
        """Work until the tree is removed, the removal gave up, or ``deadline`` (a
        ``time.monotonic()`` value) passed. Returns True when nothing more will be done.
        Never raises."""
        if self.done:
            return True
        try:
            if not self._started:
                self._started = True
                if not self._open_top():
                    self._finish()
                    return True
            while self._stack and not self.gave_up:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._advance(deadline)
            self._finish()
        except Exception as exc:  # a bug must never take the caller (the reaper) down
            self._error("internal error", f"{type(exc).__name__}: {exc}")
            self._finish()
        return True

    def close(self) -> None:
        """Stop here for good (what is left stays): closes what the walk holds open."""
        if not self.done:
            self._finish()

    def _finish(self) -> None:
        for frame in self._stack:
            os.close(frame.fd)
        self._stack.clear()
        self.done = True

    def _open_top(self) -> bool:
        """Open the top directory; False if there is nothing (more) to walk."""
        try:
            fd = os.open(self.path, _DIR_FLAGS)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # not a directory: just a name
                try:
                    os.unlink(self.path)
                    self.removed += 1
                except OSError as exc2:
                    self._error(self.path, exc2)
                return False
            fixed = self._open_fixed(None, self.path) if exc.errno == errno.EACCES else None
            if fixed is not None:
                self._dev = os.fstat(fixed).st_dev
                self._stack.append(_Frame(fixed, ""))
                return True
            self._error(self.path, exc)
            return False
        st = os.fstat(fd)
        self._dev = st.st_dev
        self._own_mode(fd, st)
        self._stack.append(_Frame(fd, ""))
        return True

    def _own_mode(self, fd: int, st: os.stat_result) -> None:
        """Give a directory of ours that its mode closes to us back rwx (it is going)."""
        if self._euid != 0 and st.st_uid == self._euid and st.st_mode & 0o700 != 0o700:
            try:
                os.fchmod(fd, 0o700)
            except OSError:
                pass

    def _open_fixed(self, parent: int | None, name: str) -> int | None:
        """Open a directory its mode keeps us out of: chmod it first (through an O_PATH
        handle, so no link is followed and no other file is touched)."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            handle = os.open(name, flags) if parent is None else _open_dir(parent, name, flags)
        except OSError:
            return None
        try:
            st = os.fstat(handle)
            if st.st_dev != self._dev and self._dev is not None:
                return None
            os.chmod(f"/proc/self/fd/{handle}", 0o700)
            # The magic link names this very directory (so no O_NOFOLLOW, which refuses it).
            return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        finally:
            os.close(handle)

    def _advance(self, deadline: float | None) -> None:
        frame = self._stack[-1]
        if frame.batch:
            self._descend(frame, frame.batch.pop())
            return
        if self._scan(frame, deadline):
            return  # it found subdirectories (or ran out of time): come back to it
        # Nothing left here but what cannot be removed: leave it.
        self._stack.pop()
        os.close(frame.fd)
        parent = self._stack[-1] if self._stack else None
        if frame.skipped:
            if parent is not None:
                parent.skipped.add(frame.name)  # (its entries were counted and reported)
            return
        try:
            if parent is None:
                os.rmdir(self.path)
            else:
                os.rmdir(frame.name, dir_fd=parent.fd)
            self.removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            if parent is None:
                self._error(self.path, exc)
            elif exc.errno == errno.ENOTEMPTY:  # it filled up again: walk it again, a few times
                tries = parent.retries.get(frame.name, 0) + 1
                parent.retries[frame.name] = tries
                if tries > _MAX_RETRIES:
                    self._skip(parent, frame.name, exc)
            elif not (exc.errno == errno.EPERM and self._unflag(parent, frame.name, True)):
                self._skip(parent, frame.name, exc)

    def _scan(self, frame: _Frame, deadline: float | None) -> bool:
        """Read the directory once: unlink what is not a directory, collect up to BATCH
        subdirectories. True if there is more to do in it (subdirectories, or the deadline
        passed half way)."""
        os.lseek(frame.fd, 0, os.SEEK_SET)
        count = 0
        with os.scandir(frame.fd) as entries:
            for entry in entries:
                name = entry.name
                if name in frame.skipped:
                    continue
                count += 1
                if deadline is not None and count % 32 == 0 and time.monotonic() >= deadline:
                    frame.batch.clear()
                    return True
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if is_dir:
                    frame.batch.append(name)
                    if len(frame.batch) >= BATCH:
                        break
                    continue
                self._unlink(frame, name)
                if self.gave_up:
                    return False
        return bool(frame.batch)

    def _unlink(self, frame: _Frame, name: str) -> None:
        try:
            os.unlink(name, dir_fd=frame.fd)
            self.removed += 1
            return
        except FileNotFoundError as exc:
            if _exists(frame.fd, name):  # listed, yet not there: never loop on it
                self._skip(frame, name, exc)
            return
        except IsADirectoryError:  # it became one under the walk
            frame.batch.append(name)
            return
        except OSError as exc:
            if exc.errno == errno.EPERM and self._unflag(frame, name, False):
                try:
                    os.unlink(name, dir_fd=frame.fd)
                    self.removed += 1
                    return
                except OSError as exc2:
                    exc = exc2
            self._skip(frame, name, exc)

    def _unflag(self, frame: _Frame, name: str, is_dir: bool) -> bool:
        """After an EPERM: clear immutable/append-only flags on the directory and, unless it
        has other names (a hard link to a file elsewhere), on the entry. True if any were."""
        cleared = False
        if not frame.fixed:
            frame.fixed = True
            cleared = _clear_flags(frame.fd)
        try:
            st = os.stat(name, dir_fd=frame.fd, follow_symlinks=False)
        except OSError:
            return cleared
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
            try:
                if stat.S_ISDIR(st.st_mode):
                    fd = _open_dir(frame.fd, name)
                else:
                    fd = os.open(
                        name,
                        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                        dir_fd=frame.fd,
                    )
            except OSError:
                return cleared
            try:
                again = os.fstat(fd)
                if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):
                    cleared = _clear_flags(fd) or cleared
            finally:
                os.close(fd)
        return cleared

    def _descend(self, frame: _Frame, name: str) -> None:
        if len(self._stack) >= MAX_DEPTH:
            self._move_up(frame, name)
            return
        try:
            fd = _open_dir(frame.fd, name)
        except FileNotFoundError as exc:
            if _exists(frame.fd, name):  # listed, yet not there: never loop on it
                self._skip(frame, name, exc)
            return
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # no longer a directory
                self._unlink(frame, name)
                return
            if exc.errno == errno.EXDEV:
                self._skip(frame, name, "a mount point: not crossed")
                return
            fixed = self._open_fixed(frame.fd, name) if exc.errno == errno.EACCES else None
            if fixed is None:
                self._skip(frame, name, exc)
                return
            fd = fixed
        st = os.fstat(fd)
        if st.st_dev != self._dev:  # (without openat2) another filesystem mounted here
            os.close(fd)
            self._skip(frame, name, "another filesystem: not crossed")
            return
        self._own_mode(fd, st)
        self._stack.append(_Frame(fd, name))

    def _move_up(self, frame: _Frame, name: str) -> None:
        """Too deep to hold open: move the subtree to the top, to be walked from there."""
        top = self._stack[0]
        for _ in range(100):
            self._moved += 1
            target = f".toolpool-rm-{self._moved}"
            try:
                os.rename(name, target, src_dir_fd=frame.fd, dst_dir_fd=top.fd)
                return
            except FileNotFoundError:
                if not _exists(frame.fd, name):
                    return
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    continue  # that name is taken at the top: another
                if exc.errno == errno.EACCES:  # our own directory, closed by its mode
                    fd = self._open_fixed(frame.fd, name)
                    if fd is not None:
                        os.close(fd)
                        continue
                self._skip(frame, name, exc)
                return
        self._skip(frame, name, "could not be moved up to be removed")


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def remove_tree(path: str, timeout: float | None = None) -> Removal:
    """Remove ``path`` and everything under it (see the module docstring), for at most
    ``timeout`` seconds. Returns the :class:`Removal`: ``done`` says whether it ended (then
    ``finished``: whether the tree is gone), and it can be resumed with ``step()``."""
    removal = Removal(path)
    removal.step(None if timeout is None else time.monotonic() + timeout)
    return removal


def main(argv: list[str]) -> int:
    """``python -P _remove.py PATH...``: remove each tree; exit status 1 if one is left."""
    left = 0
    for path in argv:
        removal = remove_tree(path)
        if not removal.finished:
            left += 1
            print(removal.summary(), file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
