"""Chat data: `messages` records rendered with a real tokenizer directory's chat template give
the tokens transformers' apply_chat_template gives, and a loss mask on the assistant tokens
equal to its {% generation %} assistant mask; BOS is never doubled; EOS ends every sequence.
Parquet files and `datasets.save_to_disk` directories read like JSONL, with column mapping.
data.tokenizer=auto picks model.init_from_hf's directory, then the run's recorded tokenizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_rlhf.config import Config, load_config
from megatron_rlhf.data.chat import load_chat_template, tokenize_chat, tokenize_chat_prompt
from megatron_rlhf.data.encode import collate_sft, encode_preferences, encode_prompt_records, encode_sft
from megatron_rlhf.data.jsonl import DataError, RecordFields, read_preferences, read_prompts, read_sft
from megatron_rlhf.data.tokenizers import HFTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
# ChatML (Qwen): the assistant's content, <|im_end|> and the newline after it are its turn.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
          "{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 3: the template writes the BOS token itself (and the tokenizer's post-processor adds one).
LLAMA3 = ("{% for m in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
          "{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a café in Paris."},
                {"role": "assistant", "content": "Café de Flore."},
                {"role": "user", "content": "And one in Rome?"},
                {"role": "assistant", "content": "Antico Caffè Greco, near the Spanish Steps."}]
CORPUS = [m["content"] for m in CONVERSATION] * 3 + ["system user assistant the a of in and"]


def make_chat_tokenizer_dir(directory: Path, template: str, eos: str, post_processor_bos: bool = False) -> Path:
    """A byte-level BPE tokenizer directory (trained here on a few sentences) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    steps = [processors.ByteLevel(trim_offsets=False)]
    if post_processor_bos:  # as Llama 3's tokenizer.json: "<|begin_of_text|> $A"
        bos_id = tok.token_to_id("<|begin_of_text|>")
        steps.append(processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                   special_tokens=[("<|begin_of_text|>", bos_id)]))
    tok.post_processor = processors.Sequence(steps)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "chat_template": template,
              "bos_token": "<|begin_of_text|>" if post_processor_bos else None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


CASES = {  # template, eos token, post-processor BOS
    "chatml_eos_im_end": (CHATML, "<|im_end|>", False),  # Qwen instruct: the turn ends with the EOS
    "chatml_eos_endoftext": (CHATML, "<|endoftext|>", False),  # a base tokenizer: EOS appended
    "llama3": (LLAMA3, "<|eot_id|>", True),
    "chatml_post_processor_bos": (CHATML, "<|im_end|>", True),  # the template writes no BOS
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    template, eos, bos = CASES[request.param]
    directory = make_chat_tokenizer_dir(tmp_path_factory.mktemp(request.param) / "tok", template, eos, bos)
    ours = HFTokenizer(directory)
    ours.chat_template = load_chat_template("auto", ours)
    from transformers import AutoTokenizer

    return request.param, ours, AutoTokenizer.from_pretrained(str(directory))


def test_conversation_tokens_and_assistant_mask_match_transformers(case):
    name, ours, theirs = case
    chat = tokenize_chat(ours, CONVERSATION, 0, False, "test")
    out = theirs.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    want_ids, want_mask = list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
    assert sum(want_mask) > 10
    if name == "chatml_post_processor_bos":  # the tokenizer's BOS, which transformers leaves out
        want_ids, want_mask = [ours.bos_id, *want_ids], [False, *want_mask]
    if name == "llama3":  # the template's BOS, once
        assert want_ids.count(ours.bos_id) == chat.ids.count(ours.bos_id) == 1
    if name == "chatml_eos_endoftext":  # no EOS in the turn: appended and trained
        assert chat.ids == [*want_ids, ours.eos_id] and chat.targets == [*want_mask, True]
    elif name.startswith("chatml"):  # the turn's EOS ends it; the newline after it is left out
        assert chat.ids == want_ids[:-1] and chat.targets == want_mask[:-1]
        assert theirs.decode(want_ids[-1:]) == "\n"
    else:
        assert chat.ids == want_ids and chat.targets == want_mask
    assert chat.ids[-1] == ours.eos_id


def test_last_assistant_only_and_prompt_rendering(case):
    name, ours, theirs = case
    every = tokenize_chat(ours, CONVERSATION, 0, False, "test")
    last = tokenize_chat(ours, CONVERSATION, 0, True, "test")
    assert last.ids == every.ids and 0 < sum(last.targets) < sum(every.targets)
    first_last = last.targets.index(True)
    assert last.targets[first_last:] == every.targets[first_last:] and not any(last.targets[:first_last])
    prompt = CONVERSATION[:-1]
    want = list(theirs.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)
                ["input_ids"])
    want = [ours.bos_id, *want] if name == "chatml_post_processor_bos" else want
    assert tokenize_chat_prompt(ours, prompt, "test") == want
    # the prompt is exactly the tokens before the last trained turn
    assert every.ids[:first_last] == want


def test_collated_loss_mask_predicts_exactly_the_assistant_tokens(case):
    _, ours, _ = case
    [item], report = encode_sft(read_sft_records([{"messages": CONVERSATION}]), ours, 512, "truncate")
    batch = collate_sft([item], ours.pad_id, 520)
    chat = tokenize_chat(ours, CONVERSATION, 0, False, "test")
    predicted = [t + 1 for t in batch["loss_mask"][0].nonzero().flatten().tolist()]
    assert predicted == [t for t, target in enumerate(chat.targets) if target]
    # truncated: the mask stops with the sequence; dropped when nothing trained is left
    cut = chat.targets.index(True) + 3
    [short], report = encode_sft(read_sft_records([{"messages": CONVERSATION}]), ours, cut, "truncate")
    assert len(short.tokens) == cut and report.truncated == 1 and sum(short.targets) == 3


def read_sft_records(rows: list[dict]) -> list:
    from megatron_rlhf.data.jsonl import _sft_record

    return [_sft_record(row, f"row {i}", RecordFields()) for i, row in enumerate(rows)]


def test_preference_and_prompt_conversations_encode_with_shared_prompt(case, tmp_path):
    _, ours, _ = case
    prompt = CONVERSATION[:2]
    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "Café de Flore."}],
             "rejected": "Nowhere."},
            # TRL's implicit prompt: full conversations sharing their first messages
            {"chosen": [*prompt, {"role": "assistant", "content": "Café de Flore."}],
             "rejected": [*prompt, {"role": "assistant", "content": "Nowhere."}]},
            # UltraFeedback-binarized: a text prompt beside full conversations
            {"prompt": prompt[-1]["content"], "chosen": [*prompt, {"role": "assistant", "content": "Café de Flore."}],
             "rejected": [*prompt, {"role": "assistant", "content": "Nowhere."}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = read_preferences(path)
    assert pairs[0] == pairs[1] == pairs[2]
    [a, b, _], _ = encode_preferences(pairs, ours, 512, "truncate")
    assert a == b and a.chosen[: a.prompt_len] == a.rejected[: a.prompt_len]
    assert a.chosen[: a.prompt_len] == tokenize_chat_prompt(ours, prompt, "t")
    assert a.chosen[-1] == a.rejected[-1] == ours.eos_id
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"messages": prompt, "answer": "Flore"}) + "\n")
    [record] = read_prompts(prompts_file)
    assert record.prompt == prompt[-1]["content"] and record.extra == {"answer": "Flore"}
    [encoded], _ = encode_prompt_records([record], ours, 512)
    assert encoded.ids == tokenize_chat_prompt(ours, prompt, "t")


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "last message is the user's"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "role 'bot'"),
    ({"messages": []}, "an empty list"),
    ({"messages": [{"role": "user", "content": 3}]}, "content: expected a non-empty string, got int"),
])
def test_bad_conversation_errors_name_file_line_and_field(tmp_path, record, message):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "response": "ok"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=rf"sft.jsonl:2: field 'messages'.*{message}"):
        read_sft(path)


def hf_dataset(rows: list[dict]):
    """A `datasets.Dataset` of `rows`. Dataset.from_list would hash the table to fingerprint it, which
    fails with datasets 5.2.0 here (dill cannot pickle pyarrow's MonthDayNano); a given fingerprint skips that."""
    import datasets
    import pyarrow

    return datasets.Dataset(pyarrow.Table.from_pylist(rows), fingerprint=f"test{len(rows)}{hash(str(rows))}")


def test_parquet_and_save_to_disk_directories_read_like_jsonl_with_column_mapping(tmp_path):
    datasets = pytest.importorskip("datasets")  # the test extra; runs read them with pyarrow alone
    rows = [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}]
    fields = RecordFields(prompt="question", response="answer")
    jsonl = tmp_path / "sft.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = hf_dataset(rows)
    dataset.to_parquet(str(tmp_path / "sft.parquet"))
    dataset.save_to_disk(str(tmp_path / "sft_dir"))
    want = read_sft(jsonl, fields)
    assert read_sft(tmp_path / "sft.parquet", fields) == want == read_sft(tmp_path / "sft_dir", fields)
    chats = hf_dataset([{"messages": CONVERSATION, "id": 7}])
    chats.save_to_disk(str(tmp_path / "chat_dir"))
    [example] = read_sft(tmp_path / "chat_dir")
    assert list(example.messages) == CONVERSATION
    with pytest.raises(DataError, match=r"sft.parquet:row 1: field 'answer': expected a string, got null"):
        hf_dataset([rows[0], {"question": "x", "answer": None}]).to_parquet(str(tmp_path / "sft.parquet"))
        read_sft(tmp_path / "sft.parquet", fields)
    (tmp_path / "shards").mkdir()  # a directory of parquet shards, read in name order
    hf_dataset(rows[1:]).to_parquet(str(tmp_path / "shards" / "train-00001.parquet"))
    hf_dataset(rows[:1]).to_parquet(str(tmp_path / "shards" / "train-00000.parquet"))
    assert read_sft(tmp_path / "shards", fields) == want
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "dict_dir"))
    with pytest.raises(DataError, match=r"dict_dir: a DatasetDict with splits \['train'\]; name one split"):
        read_sft(tmp_path / "dict_dir", fields)


def test_conversations_without_a_template_are_refused_naming_the_file_and_fix(tmp_path):
    from megatron_rlhf.trainers.stage_data import load_stage_data, preflight

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    cfg = load_config(None, [f"checkpoint.root={tmp_path}", f"data.sft_train={path}", f"data.sft_eval={path}"])
    refused = (rf"data.sft_train={path}: holds conversations.*data.tokenizer=builtin has no chat template.*"
               r"set data.chat_template=<file.jinja>")
    with pytest.raises(DataError, match=refused):
        preflight(cfg, "sft")  # before any worker starts
    with pytest.raises(DataError, match=refused):
        load_stage_data(cfg, ("sft_train", "sft_eval"))
    # with a template file the builtin tokenizer renders them (words: unknown ones are <unk>)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML.replace("<|im_end|>", " <eos> ").replace("<|im_start|>", ""))
    cfg = load_config(None, [f"checkpoint.root={tmp_path}", f"data.sft_train={path}", f"data.sft_eval={path}",
                             f"data.chat_template={template}"])
    data = load_stage_data(cfg, ("sft_train", "sft_eval"))
    [item], _ = encode_sft(data.splits["sft_train"], data.tokenizer, 200, "truncate")
    assert item.tokens[-1] == data.tokenizer.eos_id and item.targets[-1]


def test_a_changed_recorded_tokenizer_is_refused_naming_its_files_not_itself(tmp_path):
    """The run's recorded copy (<run>/tokenizer/) edited after the run recorded it: the refusal
    names the copy's files and where to restore them from, not `set data.tokenizer=<the copy>`
    (the tokenizer it had just refused)."""
    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.trainers.stage_data import record_run, run_tokenizer

    hf = make_chat_tokenizer_dir(tmp_path / "hf", CHATML, "<|im_end|>")
    cfg, tokenizer, _ = run_tokenizer(load_config(None, [f"checkpoint.root={tmp_path}", f"data.tokenizer={hf}"]))
    record_run(cfg, tokenizer)
    recorded = tmp_path / "default" / "tokenizer"
    config = json.loads((recorded / "tokenizer_config.json").read_text())
    (recorded / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3}))
    with pytest.raises(ConfigError) as refused:
        run_tokenizer(load_config(None, [f"checkpoint.root={tmp_path}"]))  # data.tokenizer=auto: the recorded copy
    message = str(refused.value)
    assert message.startswith(f"{recorded}: the tokenizer this run recorded (data.tokenizer={hf}) has changed since")
    assert f"copy them again from {hf}" in message and f"set data.tokenizer={recorded}" not in message


def test_tokenizer_auto_is_init_from_hf_then_the_recorded_one_then_builtin(tmp_path):
    from megatron_rlhf.trainers.stage_data import auto_tokenizer, record_run, run_tokenizer

    assert Config().data.tokenizer == "auto"
    base = [f"checkpoint.root={tmp_path}"]
    assert auto_tokenizer(load_config(None, base))[0] == "builtin"
    hf = make_chat_tokenizer_dir(tmp_path / "hf", CHATML, "<|im_end|>")
    cfg, tokenizer, notes = run_tokenizer(Config(model=Config().model.__class__(init_from_hf=str(hf)),
                                                 checkpoint=load_config(None, base).checkpoint))
    assert cfg.data.tokenizer == str(hf) and isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template
    assert notes == [f"data.tokenizer=auto: {hf} (model.init_from_hf)"]
    record_run(cfg, tokenizer)  # what the first stage does; a later stage without init_from_hf uses it
    cfg2, tokenizer2, _ = run_tokenizer(load_config(None, base))
    assert cfg2.data.tokenizer == str(tmp_path / "default" / "tokenizer")
    assert tokenizer2.fingerprint() == tokenizer.fingerprint() and tokenizer2.chat_template.source == CHATML
    # an init_from_hf directory without a tokenizer (weights only): builtin, said in a note
    weights_only = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from_hf=str(tmp_path)),
                                       data=dataclasses.replace(cfg.data, tokenizer="auto"),
                                       checkpoint=dataclasses.replace(cfg.checkpoint, root=str(tmp_path / "w")))
    resolved, _, notes = run_tokenizer(weights_only)
    assert resolved.data.tokenizer == "builtin" and "has no tokenizer.json" in notes[0]
    # an explicit value wins over init_from_hf
    explicit = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="builtin"),
                                   checkpoint=dataclasses.replace(cfg.checkpoint, root=str(tmp_path / "other")))
    assert run_tokenizer(explicit)[0].data.tokenizer == "builtin"
