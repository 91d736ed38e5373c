"""What the Mooncake wrappers read of a call's arguments, where a caller's values are hostile or out of range
(*no engine*: the counting functions the wrappers call, on the arrays, tables and hints a caller hands them)."""

import array

import numpy as np

from otel_kvtransfer import semconv
from otel_kvtransfer.engines import mooncake


def test_an_unsigned_array_whose_sum_wraps_is_summed_exactly():
    """numpy sums uint64 modulo 2**64 (an unsigned -1 and 4,096 make 4,095): the wrapper hands the exact sum on,
    beyond int64, for the builder to count as invalid_length and clamp."""
    lengths = np.array([2**64 - 1, 4096], dtype=np.uint64)
    assert mooncake._array_total(lengths) == (2**64 + 4095, 2)
    assert mooncake._array_total(np.array([4096, 8192, 1], dtype=np.uint64)) == (12289, 3)
    assert mooncake._array_total(array.array("Q", [2**64 - 1, 1])) == (2**64, 2)
    assert mooncake._array_total(array.array("q", [-5, 7])) == (2, 2)


def test_a_float_pages_table_is_no_lengths():
    """A float64 fields table's bits read as integers would be 1e21 bytes: its length is reported as -1 (counted by
    the builder as invalid_length); an integer table's lengths are read as ever."""
    pages = np.zeros(3, dtype=np.int64)
    integers = np.array([[0, 0, 0, 0, 700], [0, 0, 0, 0, 24]], dtype=np.int64)
    assert mooncake._pages_count((None, pages, None, integers), {}) == (3 * 724, 6)
    assert mooncake._pages_count((None, pages, None, integers.astype(np.float64)), {}) == (-1, 6)


def test_nic_hints_are_kept_by_their_shown_name_bounded():
    """Hints a caller invents are kept by their name cut to 64 characters, never by the caller's object: 300 hints
    of a megabyte each keep at most 256 names of 64 characters; a hint whose hashing raises is never hashed."""
    mooncake._hinted.clear()
    try:
        for i in range(300):
            extra = mooncake._hint_extra(f"{i:04d}" + "x" * (1 << 20))
            assert len(extra[semconv.NIC]) == 64
        assert len(mooncake._hinted) <= 256
        assert all(type(key) is str and len(key) <= 64 for key in mooncake._hinted)

        class Unhashable:
            def __hash__(self):
                raise AssertionError("hashed")

            def __str__(self):
                return "mlx5_7"

        assert mooncake._hint_extra(Unhashable()) == {semconv.NIC: "mlx5_7"}
        assert mooncake._hint_extra("mlx5_7") is mooncake._hint_extra(Unhashable())
    finally:
        mooncake._hinted.clear()


def test_scatter_lists_are_summed_when_the_call_returns():
    """A scatter's caller may refill its lists before it drains the ticket: the count is made at the call (a
    count kept by reference and summed later read 2 bytes here)."""
    lengths = [[4096], [4096]]
    counted = mooncake._scatter_count((None,) * 7 + (lengths,), {})
    for one in lengths:
        one[:] = [1]
    assert counted == (8192, 2)
