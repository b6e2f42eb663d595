"""ReuseConfig: defaults, the KVREUSE_* environment table, validation, per-request overrides."""

import dataclasses

import pytest

from kvsplice.reuse.config import (
    _INT_RANGE, CONTROL_FIELDS, ENV_TABLE, FIELD_TYPES, REQUEST_FIELDS, ReuseConfig, SettingError, check_field, parse_request_override,
)


def test_defaults_follow_the_overlay_config():
    cfg = ReuseConfig()
    assert (cfg.enabled, cfg.max_spans, cfg.tail, cfg.min_span, cfg.max_sessions) == (True, 6, 16, 64, 16)
    assert (cfg.match_min_tokens, cfg.match_min_ratio, cfg.match_min_coverage, cfg.match_ambig_margin) == (64, 0.5, 0.3, 0.15)
    assert (cfg.match_chunk_tokens, cfg.match_min_run, cfg.match_max_postings, cfg.match_max_candidates) == (16, 16, 8, 4)
    assert [ReuseConfig(match_min_tokens=n).match_chunk_tokens for n in (1, 16, 100, 1024)] == [4, 4, 16, 256]
    assert (cfg.fastdiff_min, cfg.cdc_target, cfg.no_rerotate) == (2048, 64, False)


def test_env_table_covers_every_field_but_the_controls_once_with_unique_names_and_flags():
    fields = [entry.field for entry in ENV_TABLE] + sorted(CONTROL_FIELDS)
    assert sorted(fields) == sorted(spec.name for spec in dataclasses.fields(ReuseConfig)) == sorted(FIELD_TYPES)
    assert len({entry.name for entry in ENV_TABLE}) == len(ENV_TABLE)
    assert len({entry.flag for entry in ENV_TABLE}) == len(ENV_TABLE)
    assert all(entry.name.startswith("KVREUSE_") and entry.flag.startswith("--scr-") and entry.help for entry in ENV_TABLE)


def test_from_env_applies_overlay_names():
    env = {"KVREUSE_MAX_BLOCKS": "3", "KVREUSE_V6_MIN_EXTEND": "8", "KVREUSE_V6_MIN_TAIL": "32",
           "KVREUSE_ENABLED": "0", "KVREUSE_MATCH_MIN_RATIO": "0.7", "KVREUSE_SESSION_MAX_TOKENS": "1_000",
           "UNRELATED": "x"}
    cfg = ReuseConfig.from_env(env)
    assert (cfg.max_spans, cfg.tail, cfg.min_span, cfg.enabled, cfg.match_min_ratio) == (3, 8, 32, False, 0.7)
    assert cfg.session_max_tokens == 1000
    assert ReuseConfig.from_env({}, base=cfg) == cfg


@pytest.mark.parametrize("name, raw", [
    ("KVREUSE_MAX_BLOCKS", "many"), ("KVREUSE_V6_MIN_EXTEND", "0"), ("KVREUSE_ENABLED", "maybe"),
    ("KVREUSE_MATCH_MIN_RATIO", "1.5"), ("KVREUSE_CDC_TARGET", "48"), ("KVREUSE_MATCH_MIN_TOKENS", "0"),
    ("KVREUSE_MATCH_MAX_POSTINGS", "0"), ("KVREUSE_MATCH_MIN_COVERAGE", "-0.1"),
])
def test_from_env_bad_values_name_the_variable(name, raw):
    with pytest.raises(ValueError, match=name):
        ReuseConfig.from_env({name: raw})


@pytest.mark.parametrize("name", ["KVREUSE_MATCH_WINDOW", "KVREUSE_MATCH_MIN_PREFIX_FRAC", "KVREUSE_MATCH_MIN_OVERLAP"])
def test_retired_overlay_variables_are_refused_not_ignored(name):
    with pytest.raises(ValueError, match=f"{name}: no longer used"):
        ReuseConfig.from_env({name: "8192"})


def test_replace_validates_and_rejects_unknown_names():
    assert ReuseConfig().replace(max_spans=2).max_spans == 2
    with pytest.raises(ValueError, match="unknown"):
        ReuseConfig().replace(max_blocks=2)
    with pytest.raises(ValueError, match="integer"):
        ReuseConfig().replace(tail=True)
    with pytest.raises(ValueError, match="boolean"):
        ReuseConfig().replace(enabled=1)
    with pytest.raises(ValueError, match=r"tail must lie in \[1, "):
        ReuseConfig(tail=0)


def test_describe_is_one_line_with_every_setting():
    line = ReuseConfig(max_spans=2).describe()
    assert "\n" not in line and "max_spans=2" in line and "enabled=1" in line
    assert all(f"{name}=" in line for name in FIELD_TYPES)


def test_request_override_off_by_scr_or_salt():
    base = ReuseConfig()
    assert parse_request_override("off", None, base).enabled is False
    assert parse_request_override(None, "kvreuse:off", base).enabled is False
    assert parse_request_override({"max_spans": 3}, "kvreuse:off", base).enabled is False
    assert parse_request_override(None, "tenant-a", base) == base
    assert parse_request_override("on", None, base) == base


def test_request_override_dict():
    cfg = parse_request_override({"max_spans": 2, "tail": 8}, None, ReuseConfig())
    assert (cfg.max_spans, cfg.tail, cfg.min_span) == (2, 8, 64)
    assert REQUEST_FIELDS <= set(FIELD_TYPES)


def test_the_no_rerotate_control_is_no_request_field_flag_or_variable():
    """A control experiment (wrong on purpose) is set only in code, never by a client or the server's
    command line or environment."""
    assert CONTROL_FIELDS == {"no_rerotate"} and not CONTROL_FIELDS & REQUEST_FIELDS
    assert not CONTROL_FIELDS & {entry.field for entry in ENV_TABLE}
    assert ReuseConfig().replace(no_rerotate=True).no_rerotate is True
    with pytest.raises(ValueError, match=r"setting\(s\) no_rerotate"):
        parse_request_override({"no_rerotate": True}, None, ReuseConfig())


@pytest.mark.parametrize("scr", [
    {"bogus": 1}, {"max_sessions": 2}, {"max_spans": "2"}, {"max_spans": 2.0}, {"no_rerotate": 1},
    {"tail": 0}, {"max_spans": True}, "sometimes", 3,
])
def test_request_override_rejects_bad_input(scr):
    with pytest.raises(ValueError):
        parse_request_override(scr, None, ReuseConfig())


def test_every_numeric_setting_has_an_upper_bound():
    numeric = {name for name, kind in FIELD_TYPES.items() if kind in (int, float)}
    assert {name for name, kind in FIELD_TYPES.items() if kind is int} == set(_INT_RANGE)
    for name in numeric:
        kind = FIELD_TYPES[name]
        upper = _INT_RANGE[name][1] if kind is int else 1.0
        check_field(name, upper)
        for beyond in ((upper * 2 if kind is int else 1.5), 2**60, float("nan"), float("inf")):
            if kind is int and isinstance(beyond, float):
                continue
            with pytest.raises(SettingError, match=name):
                check_field(name, beyond)


def test_the_issue_reproducer_is_refused_naming_the_field():
    """{"cdc_target": 2**60, "fastdiff_min": 0} once overflowed the diff's fast path."""
    with pytest.raises(SettingError, match=r"scr\.cdc_target must lie in \[4, 65536\]") as refused:
        parse_request_override({"cdc_target": 2**60, "fastdiff_min": 0}, None, ReuseConfig())
    assert refused.value.param == "scr.cdc_target"
    assert parse_request_override({"cdc_target": 2**16, "fastdiff_min": 0}, None, ReuseConfig()).cdc_target == 2**16
    for scr, param in (({"tail": 10**9}, "scr.tail"), ({"max_spans": 5000}, "scr.max_spans"),
                       ({"min_span": -1}, "scr.min_span"), ({"bogus": 1}, "scr.bogus"), ("maybe", "scr")):
        with pytest.raises(SettingError) as refused:
            parse_request_override(scr, None, ReuseConfig())
        assert refused.value.param == param


def test_env_values_beyond_their_bound_name_the_variable():
    with pytest.raises(ValueError, match="KVREUSE_CDC_TARGET"):
        ReuseConfig.from_env({"KVREUSE_CDC_TARGET": str(2**60)})
    with pytest.raises(ValueError, match="KVREUSE_MATCH_AMBIG_MARGIN"):
        ReuseConfig.from_env({"KVREUSE_MATCH_AMBIG_MARGIN": "inf"})
