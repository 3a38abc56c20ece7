"""docs/config_reference.md is generated from the config dataclasses and the comments above their
fields (megatron_rlhf/config/reference.py); these tests keep it current and every key documented."""

import dataclasses

from megatron_rlhf.config import Config, RLConfig
from megatron_rlhf.config.reference import REFERENCE, REGENERATE, all_keys, field_help, render

# Keys with no help text yet, each with whose comment it waits for. Keep this short: document a
# new field with a `#` comment above it (or at the end of its line) instead of listing it here.
UNDOCUMENTED: set[str] = set()


def test_committed_reference_is_current():
    assert REFERENCE.read_text() == render(), f"docs/config_reference.md is out of date: run `{REGENERATE}`"


def test_every_key_has_help_text():
    missing = {key.name for key in all_keys() if not key.help}
    assert not missing - UNDOCUMENTED, (f"config fields without a help comment: {sorted(missing - UNDOCUMENTED)}; "
                                        "add a `#` comment above each field (or at the end of its line)")
    assert not UNDOCUMENTED - missing, f"documented now: remove {sorted(UNDOCUMENTED - missing)} from UNDOCUMENTED"


def leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        keys |= leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def test_reference_lists_every_recipe_key_once():
    names = [key.name for key in all_keys()]
    assert len(names) == len(set(names))
    reward_fields = {f"rl.rewards[].{f.name}" for f in dataclasses.fields(RLConfig().rewards[0])}
    assert set(names) == leaf_keys(Config().to_dict()) | reward_fields  # rl.rewards: the list and each item's keys


def test_help_is_the_comment_above_and_at_the_end_of_the_line():
    from megatron_rlhf.config import ModelConfig, StageConfig

    assert field_help(ModelConfig, "num_query_groups").startswith("Grouped-query attention: number of key/value")
    assert field_help(RLConfig, "steps") == "iterations: generate -> score -> train"  # at the end of its line
    assert field_help(StageConfig, "save_interval") == "0: save only at the end of the stage."
    # no comment of its own: the comment block of its group that names it
    assert field_help(RLConfig, "clip_eps_high").startswith("Policy loss: ratio clipped to [1 - clip_eps, 1 + ")
