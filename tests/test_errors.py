"""The TF error classes: codes, constructors, pickling (``tf.errors``)."""

import pickle

import pytest

from torchsupervisor import errors

# TF's canonical codes (tensorflow/core/protobuf/error_codes.proto).
CODES = [
    ("CancelledError", 1),
    ("UnknownError", 2),
    ("InvalidArgumentError", 3),
    ("DeadlineExceededError", 4),
    ("NotFoundError", 5),
    ("AlreadyExistsError", 6),
    ("PermissionDeniedError", 7),
    ("ResourceExhaustedError", 8),
    ("FailedPreconditionError", 9),
    ("AbortedError", 10),
    ("OutOfRangeError", 11),
    ("UnimplementedError", 12),
    ("InternalError", 13),
    ("UnavailableError", 14),
    ("DataLossError", 15),
    ("UnauthenticatedError", 16),
]


@pytest.mark.parametrize(("name", "code"), CODES)
def test_code_round_trip(name, code):
    cls = getattr(errors, name)
    assert errors.exception_type_from_error_code(code) is cls
    assert errors.error_code_from_exception_type(cls) == code
    assert issubclass(cls, errors.OpError)
    assert f"tf.errors.{name}`` (error code {code})" in cls.__doc__


@pytest.mark.parametrize(("name", "code"), CODES)
def test_constructor_and_pickle(name, code):
    err = getattr(errors, name)(None, "op", "it broke")
    assert (err.message, err.op, err.error_code, str(err)) == ("it broke", "op", code, "it broke")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert (back.message, back.op, back.error_code) == ("it broke", "op", code)


def test_message_alone_is_the_message():
    assert errors.NotFoundError("no such file").message == "no such file"


def test_python_bases_are_kept():
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.NotFoundError, LookupError)
    assert issubclass(errors.UnimplementedError, NotImplementedError)


def test_unknown_code_raises_key_error():
    with pytest.raises(KeyError):
        errors.exception_type_from_error_code(99)


def test_subclass_of_a_coded_error_keeps_its_code():
    class Mine(errors.NotFoundError):
        """Ours."""

    assert Mine(None, None, "x").error_code == 5
    assert errors.exception_type_from_error_code(5) is errors.NotFoundError
