"""Keys and arguments: validated before any SQL, derived the same way everywhere."""

from __future__ import annotations

import hashlib

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from advisory_lock import AdvisoryLock
from advisory_lock import advisory_lock
from advisory_lock.backends import backend_for
from advisory_lock.keys import make_key
from advisory_lock.keys import shorten

MALFORMED_KEYS = [
    (None, TypeError),
    (1.5, TypeError),
    (b"job", TypeError),
    (True, TypeError),
    (False, TypeError),
    ("", ValueError),
    ("   ", ValueError),
    ("x" * 1001, ValueError),
    ("\ud800", ValueError),
    (2**63, ValueError),
    (-(2**63) - 1, ValueError),
    ((1,), TypeError),
    ((1, 2, 3), TypeError),
    ((1, "2"), TypeError),
    ((True, 1), TypeError),
    ((2**31, 0), ValueError),
    ((0, -(2**31) - 1), ValueError),
    ([1, 2], TypeError),
    ({"key": 1}, TypeError),
]
MALFORMED_OPTIONS = [
    ({"timeout": -1}, ValueError),
    ({"timeout": "5"}, ValueError),
    ({"timeout": float("nan")}, ValueError),
    ({"timeout": float("inf")}, ValueError),
    ({"timeout": True}, ValueError),
    ({"wait": False, "timeout": 1}, ValueError),
    ({"wait": "yes"}, TypeError),
    ({"wait": 1}, TypeError),
    ({"shared": 1}, TypeError),
    ({"shared": None}, TypeError),
    ({"scope": "global"}, ValueError),
    ({"using": 3}, TypeError),
]


# advisory_lock() builds the object without calling the class (see there): both must check.
CONSTRUCTORS = pytest.mark.parametrize(
    "make", [advisory_lock, AdvisoryLock], ids=lambda f: f.__name__
)


@CONSTRUCTORS
@pytest.mark.parametrize(("key", "error"), MALFORMED_KEYS, ids=repr)
def test_malformed_keys_are_refused_before_any_sql(using, make, key, error):
    with CaptureQueriesContext(connections[using]) as queries:
        with pytest.raises(error, match=r"str|int|range|blank|UTF-8|limit"):
            make(key, using=using)
    assert len(queries) == 0


@CONSTRUCTORS
@pytest.mark.parametrize(("options", "error"), MALFORMED_OPTIONS, ids=repr)
def test_malformed_options_are_refused_before_any_sql(using, make, options, error):
    options = {"using": using, **options}
    with CaptureQueriesContext(connections[using]) as queries, pytest.raises(error):
        make("job", **options)
    assert len(queries) == 0


@pytest.mark.parametrize(
    "options",
    [{}, {"wait": False}, {"timeout": 2.5}, {"shared": True, "scope": "session"}, {"using": ""}],
    ids=repr,
)
def test_the_function_and_the_class_make_the_same_lock(options):
    attributes = ("key", "lock_key", "using", "wait", "timeout", "shared", "scope", "_timeout")
    function_made = advisory_lock("job", **options)
    class_made = AdvisoryLock("job", **options)
    assert type(function_made) is AdvisoryLock
    for name in attributes:
        assert getattr(function_made, name) == getattr(class_made, name), name
    assert function_made.using == (options.get("using") or "default")


def test_allowed_key_forms_are_accepted():
    assert make_key("job").value == "job"
    assert make_key(2**63 - 1).value == 2**63 - 1
    assert make_key(-(2**63)).value == -(2**63)
    assert make_key((-(2**31), 2**31 - 1)).value == (-(2**31), 2**31 - 1)


def test_string_key_derivation_is_sha256_of_namespace_and_name():
    digest = hashlib.sha256(b"tests:nightly-report").digest()
    assert make_key("nightly-report").as_int64() == int.from_bytes(digest[:8], "big", signed=True)
    # A fixed value: the same in every process, Python version and machine.
    assert make_key("job", namespace="django").as_int64() == 5363234719324627336


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_readme_sql_computes_the_same_postgresql_key(using):
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT ('x' || substr(encode(sha256(convert_to(%s, 'UTF8')), 'hex'), 1, 16))"
            "::bit(64)::bigint",
            ["tests:nightly-report"],
        )
        (from_sql,) = cursor.fetchone()
    assert from_sql == make_key("nightly-report").as_int64()


def test_namespace_separates_string_keys():
    assert make_key("job", "app-a").as_int64() != make_key("job", "app-b").as_int64()
    with override_settings(ADVISORY_LOCK={"NAMESPACE": "other"}):
        assert make_key("job").identity == "other:job"


@pytest.mark.parametrize(
    "namespace", ["", "has:colon", "with space", "x" * 65, 7, None, ["app"], "ok\n"]
)
def test_invalid_namespace_setting_is_improperly_configured(namespace):
    with override_settings(ADVISORY_LOCK={"NAMESPACE": namespace}):
        with pytest.raises(ImproperlyConfigured, match="NAMESPACE"):
            make_key("job")


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_mysql_names_include_the_database_and_fit_64_characters(using):
    backend = backend_for(connections[using])
    database = connections[using].settings_dict["NAME"]
    assert backend.db_key(make_key("nightly")) == f"{database}/tests:nightly"
    long_name = backend.db_key(make_key("n" * 200))
    assert len(long_name) == 64
    assert long_name != backend.db_key(make_key("n" * 199))
    assert backend.db_key(make_key("Job")) != backend.db_key(make_key("job"))


def test_shortening_never_cuts_two_names_into_one():
    prefix = "x" * 70
    names = {shorten(f"{prefix}{i}", 64) for i in range(5000)}
    assert len(names) == 5000
    assert all(len(name) <= 64 for name in names)
    # A shortened name can never equal a plain one.
    assert shorten("ab~" + "c" * 20, 64) != "ab~" + "c" * 20


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_long_names_lock_on_mysql(using):
    from tests.probes import is_free

    with advisory_lock("a-very-long-job-name-" * 10, using=using):
        assert not is_free("a-very-long-job-name-" * 10, using)
        assert is_free("a-very-long-job-name-" * 9 + "b-very-long-job-name-", using)


# Properties of the derivation, over generated names.

from hypothesis import given  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

names = st.text(min_size=1, max_size=300).filter(lambda name: name.strip())
utf8_names = names.filter(lambda name: not any(0xD800 <= ord(c) <= 0xDFFF for c in name))


@given(utf8_names)
def test_string_keys_are_stable_in_range_and_namespaced(name):
    key = make_key(name, namespace="app-a")
    digest = hashlib.sha256(f"app-a:{name}".encode()).digest()
    assert key.as_int64() == int.from_bytes(digest[:8], "big", signed=True)
    assert -(2**63) <= key.as_int64() < 2**63
    assert key.as_int64() != make_key(name, namespace="app-b").as_int64()


@given(st.sets(utf8_names.map(lambda name: name[:120]), min_size=50, max_size=200))
@hypothesis_settings(max_examples=200, deadline=None)
def test_shortened_names_never_collide_and_fit(generated):
    # With each name's upper- and lower-case forms too: MySQL 8 folds case, MariaDB doesn't.
    variants = generated | {name.upper() for name in generated} | {n.lower() for n in generated}
    shortened = {shorten(f"test_advisory_lock/tests:{name}", 64) for name in variants}
    assert len(shortened) == len(variants)
    assert all(len(name) <= 64 and name.isascii() for name in shortened)
    # Two different names never compare equal case-insensitively either (MySQL 8).
    assert len({name.lower() for name in shortened}) == len(variants)


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.:-", min_size=1, max_size=40))
def test_plain_short_names_are_kept_readable(name):
    assert shorten(name, 64) == name


def test_the_name_memory_keeps_the_most_recently_used_names():
    from advisory_lock.keys import MAX_REMEMBERED_NAMES
    from advisory_lock.keys import recent_names

    make_key("kept-in-use")
    for number in range(MAX_REMEMBERED_NAMES * 2):
        make_key(f"churn-{number}")
        if number % 100 == 0:
            make_key("kept-in-use")  # used again: it stays
    names = recent_names()
    assert len(names) == MAX_REMEMBERED_NAMES
    assert "kept-in-use" in names and "churn-0" not in names


def test_a_key_is_validated_once_and_kept_immutable_but_a_bad_one_is_refused_every_time():
    import dataclasses

    assert make_key(41) is make_key(41)
    assert make_key("kept") is make_key("kept")
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_key("kept").value = "changed"  # shared between locks: nobody may change it
    for _ in range(2):  # a refusal is not remembered as a key
        with pytest.raises(ValueError):
            make_key(2**63)
        with pytest.raises(ValueError):
            make_key("")
        with pytest.raises(ImproperlyConfigured):
            make_key("kept", namespace="bad namespace")


def test_a_kept_key_follows_the_namespace_setting():
    with override_settings(ADVISORY_LOCK={"NAMESPACE": "app-a"}):
        first = make_key("job")
    with override_settings(ADVISORY_LOCK={"NAMESPACE": "app-b"}):
        second = make_key("job")
    assert (first.namespace, second.namespace) == ("app-a", "app-b")
    assert first.as_int64() != second.as_int64()
    assert make_key("job").namespace == settings.ADVISORY_LOCK["NAMESPACE"]


def test_the_kept_keys_are_bounded():
    from advisory_lock.keys import _int_key
    from advisory_lock.keys import _name_key

    for number in range(5000):
        make_key(f"many-{number}")
        make_key(number)
    assert _name_key.cache_info().currsize <= 1024
    assert _int_key.cache_info().currsize <= 1024


def test_subclasses_of_str_and_int_lock_as_the_plain_value():
    import enum

    class Name(str):
        pass

    class Job(enum.IntEnum):
        NIGHTLY = 7

    assert make_key(Name("job")) == make_key("job")
    assert type(make_key(Name("job")).value) is str
    assert make_key(Job.NIGHTLY) == make_key(7)
    assert type(make_key(Job.NIGHTLY).value) is int
