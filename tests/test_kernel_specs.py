"""cuflash.cuda.launch without a compiler: the BlockMask → per-tile lists the forward kernel reads."""
import numpy as np
import pytest

from cuflash.cuda import launch


@pytest.mark.parametrize("block,tile,sq,sk", [((16, 16), (128, 64), 129, 70), ((48, 48), (64, 32), 190, 190),
                                              ((128, 128), (128, 64), 256, 300), ((32, 16), (64, 64), 1, 1)])
def test_tile_lists_match_brute_force(block, tile, sq, sk):
    rng = np.random.default_rng(0)
    nq, nk = -(-sq // block[0]), -(-sk // block[1])
    grid = rng.random((2, 3, nq, nk)) < 0.4
    counts, lists, partial = launch.tile_lists(grid, block, tile[0], tile[1], sq, sk)
    assert counts.flags.c_contiguous and lists.flags.c_contiguous  # the kernel indexes them flat
    dense = grid[:, :, np.arange(sq) // block[0]][:, :, :, np.arange(sk) // block[1]]
    any_partial = False
    for b in range(2):
        for h in range(3):
            for m in range(-(-sq // tile[0])):
                want = []
                for n in range(-(-sk // tile[1])):
                    t = dense[b, h, m * tile[0]:(m + 1) * tile[0], n * tile[1]:(n + 1) * tile[1]]
                    if t.any():
                        want.append(n if t.all() else ~n)
                        any_partial |= not t.all()
                assert counts[b, h, m] == len(want)
                assert list(lists[b, h, m, :len(want)]) == want
    assert partial == any_partial
