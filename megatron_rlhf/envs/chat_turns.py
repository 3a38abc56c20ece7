"""A TurnTemplate read off the tokenizer's chat template: the text a chat model sees between the
end of its own turn and the start of its next one, with a tool's answer in between.

The template renders [user, assistant] and then [user, assistant, {role: observation_role}] with
the generation prompt; the second must extend the first (an append-only template), and what it
adds, split at the observation, gives the markers:

    ...<|im_start|>assistant\\nACTION<|im_end|>   \\n<|im_start|>tool\\n   OBS   <|im_end|>\\n<|im_start|>assistant\\n
       prompt / earlier turns     policy turn       observation_prefix   obs   observation_suffix

A policy turn ends where generation stops, at the EOS. When the template's end of an assistant
turn holds the EOS (Qwen's <|im_end|>, Llama 3's <|eot_id|>), what it writes after the EOS opens
the prefix. When it does not (a base tokenizer's <|endoftext|>), the policy writes the whole end
of turn and then its EOS, as SFT trains it (data/chat.py appends the EOS after the rendered turn);
the prefix is what follows. No tool-call end marker: a turn that calls a tool ends at the EOS too.
"""

from __future__ import annotations

from megatron_rlhf.config import ConfigError
from megatron_rlhf.data.errors import DataError
from megatron_rlhf.envs.episode import TurnTemplate

# Stand-ins for the texts; no spaces or punctuation, so filters such as `| trim` keep them whole.
USER, ACTION, OBSERVATION = "UserTextStandIn", "ActionTextStandIn", "ObservationTextStandIn"
ROLE_FIELD = "rl.environment.observation_role"


def turn_template_from_chat(chat, eos_token: str, role: str) -> TurnTemplate:
    """The TurnTemplate of chat template `chat` (data/chat.py's ChatTemplate) for observations
    in messages of role `role`, for a tokenizer whose EOS is `eos_token`; ConfigError naming
    rl.environment.observation_role when the template cannot frame them append-only."""
    answered = [{"role": "user", "content": USER}, {"role": "assistant", "content": ACTION}]
    observed = [*answered, {"role": role, "content": OBSERVATION}]
    try:
        before = chat.render(answered, add_generation_prompt=False, where=ROLE_FIELD)
        after = chat.render(observed, add_generation_prompt=True, where=ROLE_FIELD)
    except DataError as err:
        raise ConfigError(f"{ROLE_FIELD}={role!r}: {err}; set {ROLE_FIELD} to the role the template gives tool "
                          "results (tool, ipython, user, ...), or give the environment class a turn_template "
                          "(docs/environments.md)") from None
    fix = "give the environment class a turn_template (docs/environments.md)"
    if not after.startswith(before) or before.count(ACTION) != 1 or after.count(OBSERVATION) != 1:
        raise ConfigError(f"{ROLE_FIELD}={role!r}: the chat template ({chat.origin}) is not append-only after an "
                          f"assistant turn (rendering a {role!r} message after it changes the text before it, or "
                          f"drops a message's content), so no fixed markers frame an observation; {fix}")
    end_of_turn = before[before.index(ACTION) + len(ACTION):]
    after_eos = end_of_turn.split(eos_token, 1)[1] if eos_token in end_of_turn else ""
    added = after[len(before):]
    prefix, suffix = added.split(OBSERVATION)
    if not suffix.strip():
        raise ConfigError(f"{ROLE_FIELD}={role!r}: the chat template ({chat.origin}) writes nothing after a "
                          f"{role!r} message with the generation prompt, so the policy's next turn would not be "
                          f"marked as its own; {fix}")
    return TurnTemplate(observation_prefix=after_eos + prefix, observation_suffix=suffix)
