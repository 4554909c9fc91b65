import pytest

from megatron_mtraining import MTrainingConfig


def test_defaults_are_valid():
    cfg = MTrainingConfig()
    assert cfg.block_size == 64 and cfg.layout == "striped" and cfg.index == "vs"
    assert cfg.inner_ring_size is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=32), "block_size"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(last_q=0), "last_q"),
    (dict(max_vertical=4, min_vertical=8), "max_vertical"),
    (dict(max_slash=2, min_slash=3), "max_slash"),
    (dict(max_slash=0), "max_slash"),
    (dict(layout="ring"), "layout"),
    (dict(index="topk"), "index"),
    (dict(inner_ring_size=0), "inner_ring_size"),
    (dict(sink_tokens=-1), "sink_tokens"),
    (dict(local_window=300, max_slash=256), "local_window"),
])
def test_invalid_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MTrainingConfig(**kwargs)


def test_vertical_floor_default_is_capped_by_the_capacity():
    """min_vertical defaults to 256, or to max_vertical where that is smaller (a small
    --mtraining-max-vertical stays valid); an explicit floor above the capacity is an error."""
    from megatron_mtraining.config import VERTICAL_FLOOR
    assert VERTICAL_FLOOR == 256 and MTrainingConfig().min_vertical == 256
    assert MTrainingConfig(max_vertical=128).min_vertical == 128
    assert MTrainingConfig(max_vertical=0, sink_tokens=0).min_vertical == 0
    assert MTrainingConfig(max_vertical=64, min_vertical=0).min_vertical == 0
    with pytest.raises(ValueError, match="lower min_vertical"):
        MTrainingConfig(max_vertical=128, min_vertical=256)


def test_block_size_128_allowed():
    assert MTrainingConfig(block_size=128).block_size == 128
