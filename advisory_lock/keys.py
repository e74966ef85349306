"""Lock keys: validation of what users pass, and its stable translation for each database.

A key is a ``str`` (namespaced, then hashed or shortened for the database), an ``int`` in
signed 64-bit range, or a pair of ints in signed 32-bit range (PostgreSQL's two-key form).
The derivation uses SHA-256, never ``hash()``, so it is the same in every process, Python
version and machine.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from dataclasses import dataclass
from dataclasses import field

from django.core.exceptions import ImproperlyConfigured

from advisory_lock.conf import get_setting

Key = str | int | tuple[int, int]

INT64_RANGE = range(-(2**63), 2**63)
INT32_RANGE = range(-(2**31), 2**31)
MAX_NAME_LENGTH = 1000
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
ALLOWED_FORMS = (
    "a non-empty str, an int in signed 64-bit range, or a tuple of two ints in signed 32-bit range"
)
# Characters that every backend's name comparison treats the same (no case folding, no
# collation, no trailing-space padding). Anything else makes the name hashed.
PLAIN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.:-/,#@+=")
_HASH_MARK = "~"  # never a plain character, so a shortened name can't equal a plain one
_HASH_LENGTH = 20  # base32 characters: 100 bits of SHA-256


# Names used in this process, newest last, for inspection; bounded so that per-request keys
# (e.g. "user:<id>") can't grow it without limit.
MAX_REMEMBERED_NAMES = 1000
_recent_names: dict[str, None] = {}


def remember_name(name: str) -> None:
    """Note that ``name`` was used as a lock key in this process (least recently used go)."""
    if _recent_names.pop(name, True) and len(_recent_names) >= MAX_REMEMBERED_NAMES:
        _recent_names.pop(next(iter(_recent_names)), None)
    _recent_names[name] = None


def recent_names() -> list[str]:
    """The lock names used in this process lately (at most MAX_REMEMBERED_NAMES)."""
    return list(_recent_names)


@dataclass(frozen=True, slots=True)
class LockKey:
    """A validated key: ``value`` as given, ``namespace`` for string keys (shared: immutable).

    ``identity`` is the canonical text of the key: ``namespace:name``, ``#int`` or
    ``#int,int``; ``LockKey.from_identity()`` reads it back.
    """

    value: Key
    namespace: str | None = None
    identity: str = field(init=False, compare=False, repr=False)
    _int64: int | tuple[int, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Frozen: both are set once, here (keys are kept and shared, see make_key()).
        if isinstance(self.value, str):
            identity = f"{self.namespace}:{self.value}"
            digest = hashlib.sha256(identity.encode()).digest()
            int64: int | tuple[int, int] = int.from_bytes(digest[:8], "big", signed=True)
        else:
            value = self.value
            identity = f"#{value[0]},{value[1]}" if isinstance(value, tuple) else f"#{value}"
            int64 = value
        object.__setattr__(self, "identity", identity)
        object.__setattr__(self, "_int64", int64)

    def as_int64(self) -> int | tuple[int, int]:
        """PostgreSQL's key: ints as given, strings as the first 8 bytes of SHA-256, signed."""
        return self._int64

    @classmethod
    def from_identity(cls, identity: str) -> LockKey:
        """The key whose ``identity`` is ``identity`` (as stored, e.g. in the ledger)."""
        if identity.startswith("#"):
            numbers = identity[1:].split(",")
            if len(numbers) == 2:
                return make_key((int(numbers[0]), int(numbers[1])))
            return make_key(int(numbers[0]))
        namespace, _, name = identity.partition(":")
        return make_key(name, namespace)

    @property
    def label(self) -> str:
        """How the key reads in messages: the name, the int or the pair."""
        if isinstance(self.value, tuple):
            return f"({self.value[0]}, {self.value[1]})"
        return str(self.value) if not isinstance(self.value, str) else repr(self.value)


def make_key(key: object, namespace: str | None = None) -> LockKey:
    """Validate ``key`` and return a LockKey; raise TypeError or ValueError naming the forms.

    Recent ints and names are validated once and kept (bounded): a lock is built on a hot path.
    """
    if type(key) is int:  # the common cases first
        return _int_key(key)
    if type(key) is str:
        configured = namespace is None
        if configured:
            namespace = get_setting("NAMESPACE")
        if type(namespace) is not str:
            _check_namespace(namespace)  # before the cache, which can't hash a list
        lock_key = _name_key(key, namespace)
        if configured:
            remember_name(key)
        return lock_key
    if isinstance(key, LockKey):
        return key
    if isinstance(key, bool):
        raise TypeError(f"Lock key must be {ALLOWED_FORMS}, not a bool ({key!r}).")
    if isinstance(key, str):  # a str subclass: as the str it equals
        return make_key(str(key), namespace)
    if isinstance(key, int):
        return _int_key(int(key))
    if isinstance(key, tuple):
        if len(key) != 2 or not all(isinstance(k, int) and not isinstance(k, bool) for k in key):
            raise TypeError(f"Lock key {key!r} is not valid: it must be {ALLOWED_FORMS}.")
        if not all(k in INT32_RANGE for k in key):
            raise ValueError(f"Lock key {key!r} is out of range: it must be {ALLOWED_FORMS}.")
        return LockKey((int(key[0]), int(key[1])))
    raise TypeError(f"Lock key must be {ALLOWED_FORMS}, not {type(key).__name__} ({key!r}).")


@functools.lru_cache(maxsize=1024)
def _int_key(value: int) -> LockKey:
    if value not in INT64_RANGE:
        raise ValueError(f"Lock key {value} is out of range: it must be {ALLOWED_FORMS}.")
    return LockKey(value)


@functools.lru_cache(maxsize=1024)
def _name_key(name: str, namespace: str) -> LockKey:
    _check_name(name)
    _check_namespace(namespace)
    return LockKey(name, namespace)


def shorten(text: str, max_length: int, *, forbidden: str = "") -> str:
    """Return ``text`` if it is plain and short enough, else a readable prefix and a hash.

    The hash covers the exact text, so distinct texts never map to one name (barring a
    100-bit SHA-256 collision), whatever case folding or collation the database applies.
    """
    if (
        len(text) <= max_length
        and PLAIN_CHARS.issuperset(text)
        and (not forbidden or set(forbidden).isdisjoint(text))
    ):
        return text
    digest = base64.b32encode(hashlib.sha256(text.encode()).digest()).decode().lower()
    room = max_length - len(_HASH_MARK) - _HASH_LENGTH
    readable = "".join(
        c if c in PLAIN_CHARS and c not in forbidden else "_" for c in text.lower()[:room]
    )
    return f"{readable}{_HASH_MARK}{digest[:_HASH_LENGTH]}"


def _check_name(name: str) -> None:
    if not name or name.isspace():
        raise ValueError(f"Lock key must be {ALLOWED_FORMS}; got an empty or blank string.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"Lock key {name[:40]!r}... is {len(name)} characters long; "
            f"the limit is {MAX_NAME_LENGTH}."
        )
    if not name.isascii():  # only a lone surrogate can't be encoded
        try:
            name.encode()
        except UnicodeEncodeError:
            raise ValueError(f"Lock key {name!r} can't be encoded as UTF-8.") from None


def _check_namespace(namespace: object) -> None:
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
        raise ImproperlyConfigured(
            f"ADVISORY_LOCK['NAMESPACE'] must be 1 to 64 letters, digits, '_', '.' or '-'; "
            f"got {namespace!r}."
        )
