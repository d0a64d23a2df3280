"""The BlockMask schedule as the kernels read it (cuflash.cuda.launch.tile_lists over cuflash.tiling.mask_tiles),
without a compiler: every kept tile listed in order, full ones as n, those that need the element test as ~n."""
import numpy as np
import pytest

from cuflash import BlockMask
from cuflash.cuda import launch
from cuflash.tiling import mask_tiles


@pytest.mark.parametrize("block,tile,sq,sk", [((16, 16), (128, 64), 129, 70), ((48, 48), (64, 32), 190, 190),
                                              ((128, 128), (128, 64), 256, 300), ((32, 16), (64, 64), 1, 1)])
@pytest.mark.parametrize("kind", ["blocks", "dense"])
def test_tile_lists_match_brute_force(block, tile, sq, sk, kind):
    rng = np.random.default_rng(0)
    nq, nk = -(-sq // block[0]), -(-sk // block[1])
    if kind == "blocks":
        bm = BlockMask(rng.random((2, 3, nq, nk)) < 0.4, block=block, seqlen_q=sq, seqlen_k=sk)
    else:
        bm = BlockMask.from_dense(rng.random((2, 3, sq, sk)) < 0.02, block=block)
    counts, lists = launch.tile_lists(*mask_tiles(bm, *tile))
    assert counts.flags.c_contiguous and lists.flags.c_contiguous  # the kernel indexes them flat
    dense, states = bm.to_dense(), np.repeat(np.repeat(bm.states, block[0], 2), block[1], 3)[:, :, :sq, :sk]
    for b in range(2):
        for h in range(3):
            for m in range(-(-sq // tile[0])):
                want = []
                for n in range(-(-sk // tile[1])):
                    rows, cols = slice(m * tile[0], (m + 1) * tile[0]), slice(n * tile[1], (n + 1) * tile[1])
                    if (states[b, h, rows, cols] != 0).any():  # some block not skipped: visited
                        want.append(n if (states[b, h, rows, cols] == 2).all() else ~n)
                    else:
                        assert not dense[b, h, rows, cols].any()
                assert counts[b, h, m] == len(want)
                assert list(lists[b, h, m, :len(want)]) == want
