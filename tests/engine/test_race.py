"""The seeded race's Triton kernel (`race_triton`) against its PyTorch twin (`race`), both on DEVICE.

Runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before triton is
first imported); PREFIXSERVE_TRITON_TEST_DEVICE=cuda runs the same tests compiled on a GPU.
The twin's own arithmetic (the hash, its blocks) is checked against whole-tensor formulas.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel's module imports triton
pytest.importorskip("triton")

from prefixserve.engine import race, race_triton  # noqa: E402

VOCAB = [5003, 2048, 1]  # three blocks and a tail; exactly one block; one token


def keys(rows: int, step: int = 3) -> torch.Tensor:
    seeds = torch.tensor([s * 2654435761 - (1 << 40) * (s % 3) for s in range(rows)])  # negative, > 32 bits
    return race.row_keys(seeds, torch.full((rows,), step)).to(DEVICE)


def pcg_reference(x: int) -> int:
    """PCG's output hash of one 32-bit word, in Python's integers."""
    state = (x * 747796405 + 2891336453) % 2**32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) % 2**32
    return (word >> 22) ^ word


def test_hash_is_pcg_of_32_bit_words():
    words = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789, 3735928559]
    assert race.pcg_(torch.tensor(words)).tolist() == [pcg_reference(w) for w in words]


@pytest.mark.parametrize("vocab", VOCAB)
def test_kernel_draws_the_twins_winners(vocab):
    """Random probabilities over 8 orders of magnitude, every 7th token masked to 0: the
    kernel's winners are the twin's arithmetic's in torch's ops on DEVICE."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(16, vocab, generator=g) ** 8
    probs[:, 1::7] = 0.0  # masked tokens (min_p, top_k) never win
    probs, k = probs.to(DEVICE), keys(16)
    want = (probs / race.noise(k, vocab)).argmax(-1)
    assert race_triton.seeded_race(probs, k).tolist() == want.tolist()
    assert bool((probs.gather(1, want[:, None]) > 0).all())


@pytest.mark.parametrize("vocab", VOCAB)
def test_kernel_noise_is_the_twins_bit_for_bit(vocab):
    """p = the twin's E makes every ratio exactly 1 where the kernel's E equals it: the winner
    is then token 0 (the first of equal ratios); a kernel E below the twin's anywhere would
    win there. And a tie planted in a later block loses to an earlier one."""
    k = keys(8, step=11)
    noise = race.noise(k, vocab)
    assert race_triton.seeded_race(noise, k).tolist() == [0] * 8
    if vocab > 2048:
        probs = torch.zeros_like(noise)
        for t in (4100, 300, 2047):  # ratio 2 (exact: a power of two) at three tokens
            probs[:, t] = noise[:, t] * 2
        assert race_triton.seeded_race(probs, k).tolist() == [300] * 8


def test_twin_blocks_equal_the_whole_tensor():
    """The twin's row blocks (`_BLOCK_ELEMENTS`) change no winner: rows of a 40-row batch
    against the same rows' race computed whole."""
    g = torch.Generator().manual_seed(0)
    probs, k = torch.rand(40, 9000, generator=g), keys(40).cpu()
    whole = (probs / race.noise(k, 9000)).argmax(-1)
    assert race.seeded_race(probs, k).tolist() == whole.tolist()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="seeded_race"):
        race.seeded_race(torch.rand(3, 10), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="float64"):
        race.seeded_race(torch.rand(2, 10, dtype=torch.float64), torch.zeros(2, dtype=torch.int64))
