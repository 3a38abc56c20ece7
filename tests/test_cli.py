"""The command line without training: each verb's own --help, print-config (the resolved config
and where each value came from), the config every stage writes into its directory, and the
report verb. Pure Python (no torch, no trainer launched): about 3 s in all, one subprocess (which
checks that print-config and report import no torch) included."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rlhf.__main__ import ALL_SECTIONS, FLAGS, VERBS, main
from megatron_rlhf.config import Config, load_config, validate, write_resolved_config
from megatron_rlhf.config.resolved import PREVIOUS_CONFIG

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "pipelines" / "tiny_cpu.yaml")
# A tiny Llama config.json (as tests/test_hf_convert.py writes them): the architecture print-config
# reports as `config.json`.
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 48,
             "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
             "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}


def run_main(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse: --help, usage errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# ----------------------------------------------------------------------------- help


def test_each_verb_has_its_own_help_with_its_flags_and_sections(capsys):
    helps = {}
    for verb, spec in VERBS.items():
        code, text = run_main(capsys, verb, "--help")
        assert code == 0, text
        helps[verb] = " ".join(text.split())  # argparse wraps at the terminal's width
        assert f"usage: python -m megatron_rlhf {verb} " in helps[verb]
        assert f"config sections read: {', '.join(spec.sections)}" in helps[verb]
        assert "[--verbose]" in helps[verb]
        for flag in FLAGS:  # its own flags, and only those
            assert (f"[{flag}" in helps[verb]) == (flag in spec.flags), (verb, flag)
    assert len(set(helps.values())) == len(VERBS)
    assert "sft, lora" in helps["sft"] and "rollout" in helps["rl"] and "rollout" not in helps["sft"]
    code, text = run_main(capsys, "--help")
    assert code == 0
    lines = text.splitlines()
    for verb, spec in VERBS.items():  # one line a verb
        assert any(line.split() == [verb, *spec.summary.split()] for line in lines), (verb, text)


def test_verb_may_follow_its_options_and_options_the_overrides(capsys):
    """As before the verbs had parsers of their own (torchrun.py and the Slurm scripts rely on it)."""
    for argv in (["--config", RECIPE, "stages", "pipeline.stages=[sft,dpo]"],
                 ["stages", "pipeline.stages=[sft,dpo]", "--config", RECIPE]):
        assert run_main(capsys, *argv) == (0, "sft\ndpo\n")
    code, text = run_main(capsys, "--config", RECIPE)
    assert code == 2 and "no command" in text and "print-config" in text
    code, text = run_main(capsys, "stages", "--config", RECIPE, "--ckpt", "x")  # not a flag of `stages`
    assert code == 2 and "unrecognized arguments: --ckpt" in text


# ----------------------------------------------------------------------------- print-config


def printed_sources(text: str) -> dict[str, tuple[object, str]]:
    """{dotted leaf: (value, source)} of print-config's output (`key: value  # from: source`)."""
    leaves, path = {}, []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or line.lstrip().startswith("-"):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        key, _, rest = line.strip().partition(":")
        path[depth:] = [key]
        if "# from: " in rest:
            value, _, source = rest.partition("  # from: ")
            leaves[".".join(path)] = (yaml.safe_load(value), source)
    return leaves


def test_print_config_says_where_each_value_came_from(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "base.yaml").write_text("checkpoint: {keep_last: 5}\nmodel: {num_layers: 7}\nsft: {steps: 3}\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: base.yaml\nsft: {{steps: 7}}\nmodel: {{from_hf_config: {hf}}}\n"
                      "ppo: {epochs: 3}\n")  # a renamed key: read as rl.epochs (noted)
    code, text = run_main(capsys, "print-config", "--config", str(recipe), "rl.steps=2")
    assert code == 0, text
    leaves = printed_sources(text)
    assert leaves["seed"] == (1234, "default")
    assert leaves["sft.steps"] == (7, "recipe") and leaves["rl.epochs"] == (3, "recipe")
    assert leaves["checkpoint.keep_last"] == (5, f"base {tmp_path / 'base.yaml'}")
    assert leaves["rl.steps"] == (2, "override")
    assert leaves["model.from_hf_config"] == (str(hf), "recipe")
    # the base's num_layers is replaced by config.json's (a note says so); unset fields are filled
    assert leaves["model.num_layers"] == (3, "config.json") and leaves["model.hidden_size"] == (48, "config.json")
    assert leaves["model.rope_scaling.type"] == (None, "config.json")
    assert leaves["model.params_dtype"] == ("float32", "default")  # a run's choice, not the architecture's
    assert "# note: model.num_layers=7 (recipe) replaced by 3" in text and "the ppo section is now rl" in text
    assert len(leaves) > 200


@pytest.mark.parametrize("override, what", [
    ("=5", "no key before '='"), (" =5", "no key before '='"),
    ("model.=5", "the key 'model.' has an empty part"), (".seed=3", "the key '.seed' has an empty part"),
    ("model..hidden_size=64", "the key 'model..hidden_size' has an empty part"),
])
def test_an_override_without_a_whole_key_says_what_is_missing(capsys, override, what):
    """`print-config =5` said `config error: : unknown key; known keys: [...]`."""
    code, text = run_main(capsys, "print-config", override)
    assert code == 2 and text.startswith(f"config error: override '{override}': {what}") and "unknown key" not in text
    assert "e.g. model.hidden_size=128" in text and text.count("\n") == 1


def test_printed_config_reads_back_equal(tmp_path, capsys):
    """--no-sources prints a recipe (annotated output reads back the same); to run it again, a recipe
    with `base: <it>` passes the rules that look at what a recipe sets (grpo with critic defaults)."""
    overrides = ["rl.steps=2", "rl.rewards=[{type: model}, {type: function, function: rewards/length.py:score, "
                 "weight: 0.5}]"]
    cfg = load_config(REPO / "pipelines" / "tiny_cpu_grpo.yaml", overrides)
    for flags in (["--no-sources"], []):
        code, text = run_main(capsys, "print-config", "--config", str(REPO / "pipelines" / "tiny_cpu_grpo.yaml"),
                              *overrides, *flags)
        assert code == 0 and ("# from:" in text) == (not flags)
        (tmp_path / "printed.yaml").write_text(text)
        assert load_config(tmp_path / "printed.yaml") == cfg
    (tmp_path / "again.yaml").write_text("base: printed.yaml\n")
    validate(load_config(tmp_path / "again.yaml"))


def test_stage_directory_config_reads_back_and_keeps_a_changed_one(tmp_path):
    cfg = load_config(RECIPE, ["sft.steps=5"])
    path = write_resolved_config(cfg, tmp_path / "sft")
    text = path.read_text()
    assert text.startswith("# The resolved config of this stage") and " UTC) by:\n#   " in text
    assert load_config(path) == cfg
    write_resolved_config(cfg, tmp_path / "sft")  # resumed with the same settings: nothing kept
    assert not (tmp_path / "sft" / PREVIOUS_CONFIG).exists()
    changed = load_config(RECIPE, ["sft.steps=9"])
    write_resolved_config(changed, tmp_path / "sft")  # resumed with more steps
    assert load_config(tmp_path / "sft" / PREVIOUS_CONFIG) == cfg and load_config(path) == changed


# ----------------------------------------------------------------------------- report


def test_report_verb_writes_the_report_of_a_run(tmp_path, capsys):
    run = tmp_path / "runs" / "demo"
    (run / "sft").mkdir(parents=True)
    (run / "sft" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert run_main(capsys, "report", "--run", str(run)) == (0, f"{run / 'report.md'}\n")
    code, text = run_main(capsys, "report", "--config", RECIPE, f"checkpoint.root={tmp_path / 'runs'}",
                          "checkpoint.run_name=demo")
    assert (code, text) == (0, f"{run / 'report.md'}\n") and "sft" in (run / "report.md").read_text()
    code, text = run_main(capsys, "report", "--run", str(tmp_path / "nowhere"))
    assert code == 2 and "no such run directory" in text
    code, text = run_main(capsys, "report")
    assert code == 2 and "--run DIR" in text
    code, text = run_main(capsys, "report", "--run", str(tmp_path))  # a directory, but no stage in it
    assert code == 2 and "holds no stage directories" in text


def test_print_config_and_report_import_no_torch(tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    code = ("import sys\nfrom megatron_rlhf.__main__ import main\n"
            f"assert main(['print-config', '--config', {RECIPE!r}]) == 0\n"
            f"assert main(['report', '--run', {str(tmp_path)!r}]) == 0\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')], 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)


def test_every_section_a_verb_names_exists():
    recipe_keys = [f.name for f in dataclasses.fields(Config) if f.metadata.get("recipe_key", True)]
    assert list(ALL_SECTIONS) == recipe_keys == list(VERBS["pipeline"].sections) == list(VERBS["print-config"].sections)
    for verb in VERBS.values():
        assert set(verb.sections) <= set(ALL_SECTIONS), verb
