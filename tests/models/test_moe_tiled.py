"""The tiled dispatch's tile heights (moe_tiled.py; its values and gradients: tests/models/test_moe.py)."""

from cisjax.models import moe_tiled


def test_tile_sizes_and_choose_tile():
    assert moe_tiled.tile_sizes(512) == (512, 128, 32, 16)
    assert moe_tiled.tile_sizes(256) == (256, 64, 16)
    assert moe_tiled.tile_sizes(128) == (128, 32, 16)
    assert moe_tiled.tile_sizes(48) == (48, 24)
    assert moe_tiled.tile_sizes(16) == (16,)
    assert moe_tiled.tile_sizes(1) == (1,)
    for rows, e in [(1, 4), (16384, 60), (8192, 8), (10**6, 2)]:
        t = moe_tiled.choose_tile(rows, e)
        assert 16 <= t <= 512 and t & (t - 1) == 0
