"""The built-in tool-calling task, with no network: arithmetic the policy cannot do alone, and a calculator.

docs/agents.md shows a run (`GRPOTrainer(model_folder(), answer_reward, tools=TOOLS, ...)`). The policy is a tiny
Qwen3-shaped model that this module SFTs on CPU in JAX on first use (cached under `demo.CACHE_ROOT`), with a
byte-level BPE trained on the same conversations and TRL's Qwen3 training chat template (prefix-preserving, so a tool
result's tokens are an exact suffix) and the Qwen3 response template (so `parse_response` reads its tool calls).

The task: `What is 47 * 86?`. The SFT data answers half of the multiplication questions by calling `multiply` and
reading its result back, the other half with a made-up number (reward: the final answer equals the product; a
greedy policy that guesses gets 0, and calling the tool is what there is to learn). Other prompt kinds make
greedy decoding call a tool, call an unknown one (`power`), pass bad arguments, raise (`divide` by 0), make two calls
in one turn, chain two rounds, or answer directly: the whole-trainer parity test against TRL (tests/test_tools_parity.py)
uses them.

The chat template and the response template below are TRL 1.16's (`trl/chat_templates/qwen3_training.jinja` and
`trl.chat_template_utils.qwen3_template`, Apache-2.0, The HuggingFace Team), copied so the demo needs no TRL.
"""

from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path
from typing import Any

from rloo_jax import demo

# ------------------------------------------------------------------------------------------------ the tools


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide two integers.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b  # raises ZeroDivisionError for b = 0: a failing call


TOOLS = [multiply, add, divide]


def answer_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's last assistant turn says `The answer is <answer>.`, else 0.0."""
    out = []
    for messages, expected in zip(completions, answer, strict=True):
        turns = [m for m in messages if m.get("role") == "assistant"]
        text = turns[-1].get("content", "") if turns else ""
        out.append(float(text.strip() == f"The answer is {expected}."))
    return out


# ------------------------------------------------------------------------------------------------ templates
QWEN3_TRAINING_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
        {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
        {%- endgeneration %}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

QWEN3_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


# ------------------------------------------------------------------------------------------------ conversations
def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _tool(name: str, value: Any) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": str(value)}


def _assistant(content: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def _error(exc: Exception) -> str:
    return str({"error": str(exc)})


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def conversation(kind: str, a: int, b: int, rng: random.Random) -> list[dict[str, Any]]:
    """One SFT conversation (user prompt first) of `kind`:
    - `tool`: `What is a * b?` -> multiply(a, b) -> the product -> `The answer is <product>.`
    - `guess`: the same question answered directly with a made-up number (wrong: the tool is worth learning)
    - `add`: `add a b` -> add(a, b) -> `The answer is <sum>.`
    - `both`: `add and multiply a b` -> add and multiply in one turn -> `The answers are <sum> and <product>.`
    - `chain`: `add a b then multiply by 3` -> add -> multiply(sum, 3) -> `The answer is <...>.` (two rounds)
    - `power`: `power a b` -> a call of the unknown tool `power` -> its error -> `I cannot.`
    - `divide`: `divide a by 0` -> divide(a, 0) raises -> `I cannot.`
    - `bad`: `double a` -> multiply(x=a) (bad arguments) -> its error -> `I cannot.`
    - `say`: `say hello to a` -> `Hello a.` (no tool)."""
    p, s = a * b, a + b
    if kind in ("tool", "guess"):
        user = {"role": "user", "content": question(a, b)}
        if kind == "guess":
            wrong = p + rng.choice([-1, 1]) * rng.randint(1, 90)
            return [user, _assistant(f"The answer is {wrong}.")]
        return [user, _assistant(calls=[_call("multiply", a=a, b=b)]), _tool("multiply", p),
                _assistant(f"The answer is {p}.")]
    if kind == "add":
        return [{"role": "user", "content": f"add {a} {b}"}, _assistant(calls=[_call("add", a=a, b=b)]),
                _tool("add", s), _assistant(f"The answer is {s}.")]
    if kind == "both":
        return [{"role": "user", "content": f"add and multiply {a} {b}"},
                _assistant(calls=[_call("add", a=a, b=b), _call("multiply", a=a, b=b)]), _tool("add", s),
                _tool("multiply", p), _assistant(f"The answers are {s} and {p}.")]
    if kind == "chain":
        return [{"role": "user", "content": f"add {a} {b} then multiply by 3"},
                _assistant(calls=[_call("add", a=a, b=b)]), _tool("add", s),
                _assistant(calls=[_call("multiply", a=s, b=3)]), _tool("multiply", 3 * s),
                _assistant(f"The answer is {3 * s}.")]
    if kind == "power":
        return [{"role": "user", "content": f"power {a} {b}"}, _assistant(calls=[_call("power", a=a, b=b)]),
                _tool("power", _error(ValueError("Tool power not found."))), _assistant("I cannot.")]
    if kind == "divide":
        return [{"role": "user", "content": f"divide {a} by 0"}, _assistant(calls=[_call("divide", a=a, b=0)]),
                _tool("divide", _error(ZeroDivisionError("division by zero"))), _assistant("I cannot.")]
    if kind == "bad":
        return [{"role": "user", "content": f"double {a}"}, _assistant(calls=[_call("multiply", x=a)]),
                _tool("multiply", _error(TypeError("multiply() got an unexpected keyword argument 'x'"))),
                _assistant("I cannot.")]
    if kind == "say":
        return [{"role": "user", "content": f"say hello to {a}"}, _assistant(f"Hello {a}.")]
    raise ValueError(kind)


KINDS = ("tool", "guess", "add", "both", "chain", "power", "divide", "bad", "say")


def sft_conversations(num: int, seed: int) -> list[list[dict[str, Any]]]:
    """`num` SFT conversations: multiplication questions (two digits) half by `tool`, half by `guess`; the other
    kinds with one-digit numbers."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        kind = ("tool", "guess")[i % 2] if i % 3 else rng.choice(KINDS[2:])
        small = kind not in ("tool", "guess")
        a, b = (rng.randint(1, 9), rng.randint(1, 9)) if small else (rng.randint(10, 99), rng.randint(10, 99))
        out.append(conversation(kind, a, b, rng))
    return out


def task_rows(num: int, seed: int) -> list[dict[str, Any]]:
    """The RL task: `What is a * b?` (chat prompts) with the product in an `answer` column."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a * b)})
    return rows


# ------------------------------------------------------------------------------------------------ tokenizer, model
def build_tokenizer(texts: list[str], vocab_size: int = 1000) -> Any:
    """A byte-level BPE (digits split one by one, as Qwen's; merges across words, so the tools' schema text that
    every prompt repeats is a few dozen tokens: 124 tokens for the longest SFT conversation, against 601 with GPT-2's
    word split) trained on `texts`, Qwen3's special tokens (pad
    `<|endoftext|>`, EOS `<|im_end|>`), its tool and think markers as added tokens, TRL's Qwen3 training chat
    template and the Qwen3 response template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left")
    fast.chat_template = QWEN3_TRAINING_TEMPLATE
    fast.response_template = QWEN3_RESPONSE_TEMPLATE
    return fast


def model_config(vocab_size: int, eos: int, pad: int) -> dict[str, Any]:
    """Qwen3-shaped (q/k norms), hidden 64, 2 layers: ~0.2M parameters."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size, "hidden_size": 64,
        "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "initializer_range": 0.1, "bos_token_id": None,
        "eos_token_id": eos, "pad_token_id": pad, "attention_bias": False,
    }


def rendered(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A conversation's token ids and the SFT loss mask (1 on the assistant turns' tokens: what the model writes),
    rendered with the tools as the trainer renders its prompts."""
    out = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def sft(model: Any, examples: list[tuple[list[int], list[int]]], steps: int, seed: int, lr: float = 3e-3,
        batch: int = 16) -> list[float]:
    """Next-token cross-entropy on the assistant tokens, AdamW, `steps` batches drawn with `seed`: the losses."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    width = max(len(ids) for ids, _ in examples)
    ids = np.zeros((len(examples), width), np.int32)
    attn = np.zeros_like(ids)
    target = np.zeros_like(ids)
    for i, (x, m) in enumerate(examples):
        ids[i, :len(x)], attn[i, :len(x)], target[i, :len(m)] = x, 1, m
    graphdef, params = nnx.split(model)
    opt = optax.adamw(optax.cosine_decay_schedule(lr, steps, 0.1), weight_decay=0.0)
    state = opt.init(params)

    def loss_fn(p: Any, x: Any, a: Any, t: Any) -> Any:
        logits = nnx.merge(graphdef, p)(x, a)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, x[:, 1:, None], axis=-1)[..., 0]
        w = t[:, 1:].astype(jnp.float32)
        return -jnp.sum(picked * w) / jnp.maximum(jnp.sum(w), 1.0)

    @jax.jit
    def step(p: Any, s: Any, x: Any, a: Any, t: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(p, x, a, t)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        rows = rng.choice(len(examples), batch, replace=False)
        params, state, loss = step(params, state, ids[rows], attn[rows], target[rows])
        losses.append(float(loss))
    nnx.update(model, params)
    return losses


MODEL_VERSION = 2  # bumped whenever the data, tokenizer, model or SFT change: a cached folder is never reused stale


def prepare_model(directory: str | os.PathLike, seed: int = 0, steps: int = 600, num: int = 600) -> str:
    """The SFT'd tool-calling policy and its tokenizer written to `directory` (once): its path. Processes that ask
    for it together build it once: the others wait for the first's build (minutes of SFT) instead of repeating it."""
    path = Path(directory)
    if (path / "model.safetensors").is_file():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed builder exits
        if not (path / "model.safetensors").is_file():
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            save_sft_model(tmp, seed, steps, num)
            tmp.rename(path)  # a killed build leaves a tmp folder, never a half-written `path`
    return str(path)


def save_sft_model(directory: Path, seed: int, steps: int, num: int) -> None:
    """Build the tokenizer, SFT a fresh policy on `num` conversations for `steps` batches, save both to `directory`."""
    from rloo_jax.models import init_causal_lm, save_pretrained

    convs = sft_conversations(num, seed)
    probe = build_tokenizer([""], vocab_size=300)  # the template only: the texts the BPE is trained on
    texts = [probe.apply_chat_template(c, tools=TOOLS, tokenize=False) for c in convs]
    tokenizer = build_tokenizer(texts)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = init_causal_lm(model_config(len(tokenizer), eos, pad), seed=seed)
    sft(model, [rendered(tokenizer, c) for c in convs], steps, seed)
    save_pretrained(model, directory, tokenizer=tokenizer)


def model_folder(seed: int = 0) -> str:
    """The tool-calling demo policy of `seed`, built (SFT: ~3 min on 2 CPU cores) under the demo cache on first use."""
    return prepare_model(os.path.expanduser(os.path.join(demo.CACHE_ROOT, f"tools/model-v{MODEL_VERSION}-{seed}")),
                         seed)


def dataset_folder(seed: int = 0, num_train: int = 512, num_test: int = 64) -> str:
    """The multiplication prompts (train and test jsonl), written under the demo cache once: the folder."""
    return demo.prepare_dataset(os.path.expanduser(os.path.join(demo.CACHE_ROOT, f"tools/data-{seed}")), seed + 100,
                                num_train, num_test, rows=task_rows)
