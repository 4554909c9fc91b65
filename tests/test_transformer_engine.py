"""The Transformer Engine version check (integration/transformer_engine.py), on any machine."""

import logging
import types

import pytest

from megatron_mtraining.integration import transformer_engine as te_check


def test_tested_series_passes_silently(caplog):
    with caplog.at_level(logging.WARNING):
        assert te_check.check_transformer_engine("2.20.2") == "2.20.2"
    assert not caplog.records


def test_other_2x_release_warns_once(caplog):
    te_check._warned.discard("2.12.0")
    with caplog.at_level(logging.WARNING):
        assert te_check.check_transformer_engine("2.12.0") == "2.12.0"
        te_check.check_transformer_engine("2.12.0")
    warnings = [r for r in caplog.records if "2.12.0" in r.getMessage()]
    assert len(warnings) == 1 and "tested with 2.20.x" in warnings[0].getMessage()


@pytest.mark.parametrize("version", ["1.13.0", "0.9", "garbage"])
def test_unsupported_version_is_refused_naming_the_way_out(version):
    with pytest.raises(ValueError, match=rf"Transformer Engine {version} is not supported.*--transformer-impl local"):
        te_check.check_transformer_engine(version)


def test_absent_te(monkeypatch):
    monkeypatch.setattr(te_check, "installed_version", lambda: None)
    assert te_check.check_transformer_engine() is None
    with pytest.raises(ValueError, match="needs Transformer Engine.*--transformer-impl local"):
        te_check.check_transformer_engine(required=True)


def test_enable_mtraining_checks_te_only_on_te_layers(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_mtraining.integration import enable

    calls = []
    monkeypatch.setattr(enable, "check_transformer_engine", lambda required: calls.append(required))
    monkeypatch.setattr(enable.patches, "validate_megatron_config", lambda *a, **k: None)
    monkeypatch.setattr(enable.patches, "install", lambda config: None)
    monkeypatch.setattr(enable.MTrainingConfig, "from_args", classmethod(lambda cls, args: object()))
    monkeypatch.setattr(enable, "integration_options", lambda args: {"log_interval": 0, "dense_layers": 0})
    monkeypatch.setattr(enable, "check_inner_ring_size", lambda args, config: None)
    monkeypatch.setattr(enable, "check_resume", lambda args: None)
    enable.enable_mtraining(types.SimpleNamespace(transformer_impl="local", seq_length=1024))
    assert calls == []
    enable.enable_mtraining(types.SimpleNamespace(transformer_impl="transformer_engine", seq_length=1024))
    assert calls == [True]
