"""The margins tests/conftest.py compares two trainings with: what they allow on digits' 360 test
samples, and that they still fail training that broke."""

import pytest

from tests.conftest import DIGITS_CHANCE, DIGITS_TEST, accuracy_margin, assert_accuracy_near, assert_loss_near


def test_the_accuracy_margin_on_digits_is_three_binomial_errors_of_a_difference():
    # 0.9694 (349 of 360): e = 0.0306, 3 * sqrt(2 e (1 - e) / 360) = 0.0385, 13.9 samples
    margin = accuracy_margin(349 / 360, DIGITS_TEST, chance=DIGITS_CHANCE)
    assert margin == pytest.approx(0.0385, abs=1e-4)
    # a perfect reference still leaves room: e is taken as 1/n
    perfect = accuracy_margin(1.0, DIGITS_TEST, chance=DIGITS_CHANCE)
    assert perfect == pytest.approx(0.0118, abs=1e-4)


def test_the_accuracy_check_takes_kernels_and_sound_compressors_and_fails_broken_training():
    assert_accuracy_near(345 / 360, 349 / 360, "top-k on AVX512 kernels")  # the failure
    assert_accuracy_near(350 / 360, 349 / 360, "fp16", above_too=True)
    for broken in (36 / 360, 300 / 360):  # guessing; a model a tenth of the samples worse
        with pytest.raises(AssertionError, match=r"allowed 0\.0385"):
            assert_accuracy_near(broken, 349 / 360, "broken")
    with pytest.raises(AssertionError, match="fp16"):
        assert_accuracy_near(1.0, 300 / 360, "fp16", above_too=True)


def test_a_margin_that_could_not_tell_learning_from_guessing_is_refused():
    with pytest.raises(AssertionError, match="needs more test samples"):
        accuracy_margin(0.5, 20, chance=0.1)


def test_the_loss_check_takes_sound_compressors_and_fails_without_error_feedback():
    assert_loss_near(0.1495, 0.1270, "top-k at 1%")  # 1.18 times
    with pytest.raises(AssertionError, match=r"1\.69 times"):
        assert_loss_near(0.2142, 0.1270, "top-k without error feedback")
    assert_loss_near(0.1333, 0.1270, "tensorflow against torch", both_ways=True)
    with pytest.raises(AssertionError, match="either way"):
        assert_loss_near(0.05, 0.1270, "much lower", both_ways=True)
