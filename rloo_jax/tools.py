"""Tool calling on the host, as TRL 1.16's GRPOTrainer does it, plus what TRL lacks: tools as TRL takes them
(callables, sync or async, or `module:attribute` names), environments (`environment_factory`: a pool of instances,
`reset(**row)`, public methods as tools, `get_reward`), the chat-template checks and the response parsing TRL applies,
the token ids a tool result adds to a conversation (TRL's `_get_tool_suffix_ids`), and `ToolRunner`, which executes
the calls of a whole generation batch at once (sync tools in threads, async ones on one event loop) with a per-call
timeout and a per-rollout limit, reporting every failure to the model as TRL reports errors and never raising.

The device side of a multi-turn rollout is `rloo_jax.turns`; the host loop that joins the two is
`rloo_jax.conversations`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rloo_jax.errors import ConfigError

# ------------------------------------------------------------------------------------------------ tools


def resolve_object(spec: Any, what: str) -> Any:
    """A Python object as given, or named `module:attribute` (or `package.module.attribute`), as YAML and the command
    line name tools and environment factories. A name that does not resolve: ConfigError, one line."""
    if not isinstance(spec, str):
        return spec
    module, sep, attr = spec.partition(":")
    if not sep:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"{what} {spec!r}: name it as module:attribute (e.g. my_tools:calculator)")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{what} {spec!r}: cannot import {module} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {spec!r}: {module} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj


def is_async_callable(fn: Callable) -> bool:
    """Whether calling `fn` returns a coroutine (functions, partials, callable instances: TRL's test)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may call: its name (the function's `__name__`, as TRL keys its tool dicts), the callable,
    and whether it is async."""

    name: str
    fn: Callable = dataclasses.field(compare=False)
    is_async: bool = False


def as_tool(fn: Any, what: str = "tool") -> Tool:
    """A tool from a callable or a `module:attribute` name; its JSON schema (transformers' `get_json_schema`: type
    hints and a Google-style docstring, what the chat template shows the model) must build, else ConfigError."""
    fn = resolve_object(fn, what)
    if not callable(fn):
        raise ConfigError(f"{what} {fn!r} is not callable")
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds for a bad docstring or hint
        raise ConfigError(f"{what} {name}: no JSON schema from its type hints and docstring ({e}); give every "
                          "argument a type hint and a Google-style docstring with an Args section") from None
    return Tool(name, fn, is_async_callable(fn))


# ------------------------------------------------------------------------------------------------ environments


def _public_methods(instance: Any) -> list[str]:
    """The names of the methods of `instance`'s class that are tools: public functions other than reset and
    get_reward (TRL: `inspect.getmembers(type(instance), inspect.isfunction)`, so properties are not evaluated)."""
    return [name for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class EnvironmentPool:
    """TRL's `environment_factory`: one factory (every row uses it) or a dict of them (a row's `environment` column
    names its factory). One instance per rollout, drawn from a pool that grows only when a batch needs more
    instances of an environment than exist (construct once, `reset(**row)` often). An environment's public methods
    are its tools (beside the standalone ones); `get_reward`, when defined, is an extra reward function named after
    the class (weight 1), scoring only the rollouts of that class."""

    def __init__(self, factory: Any, standalone: Sequence[Tool] = ()) -> None:
        self.multi = isinstance(factory, dict)
        factories = dict(factory) if self.multi else {None: factory}
        self.factories = {name: resolve_object(f, "environment_factory") for name, f in factories.items()}
        self.pool: dict[Any, list[Any]] = {}
        self.tools: dict[Any, list[Tool]] = {}  # the tools each environment's prompts are rendered with
        self.reward_classes: list[type] = []
        for name, make in self.factories.items():
            if not callable(make):
                raise ConfigError(f"environment_factory {name!r}: {make!r} is not callable")
            instance = make()
            if not callable(getattr(instance, "reset", None)):
                raise ConfigError("Each environment instance returned by `environment_factory` must define a "
                                  "callable `reset`.")
            methods = [as_tool(getattr(instance, m), f"environment {type(instance).__name__} method")
                       for m in _public_methods(instance)]
            self.tools[name] = list(standalone) + methods
            self.pool[name] = [instance]
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_classes:
                self.reward_classes.append(type(instance))

    def assign(self, names: Sequence[Any]) -> list[Any]:
        """One instance per rollout (`names`: each rollout's environment, None with one factory), TRL's pool order:
        the k-th rollout of an environment in the batch gets that environment's k-th instance."""
        cursor: dict[Any, int] = {}
        out = []
        for name in names:
            if name not in self.factories:
                raise ConfigError(f"Example has `environment={name!r}`, which is not among the environments passed to "
                                  f"`environment_factory`. Expected one of: {list(self.factories)}.")
            pool, k = self.pool[name], cursor.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            cursor[name] = k + 1
            out.append(pool[k])
        return out

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """(name, function) per environment class with `get_reward` (TRL's extra reward sources, weight 1): the
        function takes `environments` (one per rollout) and returns its class's rollouts' rewards, None for others."""
        out = []
        for cls in self.reward_classes:
            if inspect.iscoroutinefunction(cls.get_reward):

                async def get_reward(environments: Sequence[Any], _cls: type = cls, **kwargs: Any) -> list[Any]:
                    return [await e.get_reward() if type(e) is _cls else None for e in environments]
            else:

                def get_reward(environments: Sequence[Any], _cls: type = cls, **kwargs: Any) -> list[Any]:
                    return [e.get_reward() if type(e) is _cls else None for e in environments]
            get_reward.__name__ = cls.__name__
            out.append((cls.__name__, get_reward))
        return out


def toolbox(standalone: Sequence[Tool], environment: Any = None) -> dict[str, Tool]:
    """A rollout's tools by name: the standalone ones, then its environment's public methods (bound to it)."""
    tools = list(standalone)
    if environment is not None:
        tools += [Tool(m, getattr(environment, m), inspect.iscoroutinefunction(getattr(environment, m)))
                  for m in _public_methods(environment)]
    return {t.name: t for t in tools}


# ------------------------------------------------------------------------------------------------ chat template


def supports_tool_calling(tokenizer: Any) -> bool:
    """TRL's check: the chat template renders a user -> assistant (tool call) -> tool conversation keeping the call's
    name, its argument and the tool's content."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    from jinja2 import TemplateError

    name, key, value, content = "tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", \
        "tool_content_c4f9a8e2"
    calls = [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "name": name, "content": content}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateError:
        return False
    except TypeError:
        calls[0]["function"]["arguments"] = f'{{"{key}": "{value}"}}'
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError:
            return False
    return all(s in rendered for s in (name, key, value, content))


def is_prefix_preserving(tokenizer: Any, chat_template: str | None = None) -> bool:
    """TRL's `is_chat_template_prefix_preserving`: a conversation's tokens are a prefix of its tokens with a tool
    message (and the next assistant header) appended: the property the tool-suffix ids rely on."""
    calls = [{"type": "function", "function": {"name": "dummy", "arguments": {}}}]
    first = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    second = first + [{"role": "tool", "name": "dummy", "content": "dummy"}]
    kw = {} if chat_template is None else {"chat_template": chat_template}
    ids1 = tokenizer.apply_chat_template(first, tokenize=True, return_dict=False, **kw)
    ids2 = tokenizer.apply_chat_template(second, tokenize=True, return_dict=False, add_generation_prompt=True, **kw)
    return list(ids2[: len(ids1)]) == list(ids1)


def _trl_chat_template_utils() -> Any:
    try:
        return importlib.import_module("trl.chat_template_utils")
    except ImportError:
        return None


def prepare_chat(tokenizer: Any) -> str | None:
    """TRL's set-up of a tokenizer for tool calling: its template must render tool calls (else ConfigError); a
    response template to parse the model's turns (the tokenizer's own, else TRL's `add_response_schema` for the
    chat templates it knows, when TRL is installed); and a prefix-preserving template (else TRL's training variant
    of it, `get_training_chat_template`, which the run then renders every conversation with). Returns that training
    template, or None to use the tokenizer's own."""
    if not supports_tool_calling(tokenizer):
        raise ConfigError("The provided chat template does not support tool calling. The template must be able to "
                          "render a full tool-calling conversation (user -> assistant with tool_calls -> tool).")
    trl = _trl_chat_template_utils()
    if getattr(tokenizer, "response_template", None) is None:
        if trl is None:
            raise ConfigError("tools: the tokenizer has no response_template to parse tool calls with; set one "
                              "(transformers' response parsing) or install trl, whose add_response_schema knows the "
                              "common chat templates")
        try:
            trl.add_response_schema(tokenizer)
        except ValueError as e:
            raise ConfigError(f"tools: {e}".splitlines()[0]) from None
    if is_prefix_preserving(tokenizer):
        return None
    if trl is None:
        raise ConfigError("tools: the chat template is not prefix-preserving (a tool message changes how the "
                          "earlier turns render); give the tokenizer a training template, or install trl, whose "
                          "get_training_chat_template patches the common ones")
    try:
        return trl.get_training_chat_template(tokenizer)
    except ValueError as e:
        raise ConfigError(f"tools: {e}".splitlines()[0]) from None


def _validate_tool_calls(tool_calls: Any) -> None:
    """TRL's check of parsed tool calls (ValueError for a malformed one; missing arguments become {})."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for idx, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{idx}] must be a dict.")
        func = call.get("function", call)
        if "function" in call and not isinstance(func, dict):
            raise ValueError(f"tool_calls[{idx}]['function'] must be a dict.")
        if not isinstance(func.get("name"), str):
            raise ValueError(f"tool_calls[{idx}] name must be a string.")
        if func.get("arguments") is None:
            func["arguments"] = {}


def parse_turn(tokenizer: Any, ids: Sequence[int], prefix: Sequence[int], tools: Sequence[Any] | None
               ) -> tuple[dict[str, Any], bool]:
    """One assistant turn's token ids -> (TRL's message dict, malformed). TRL's `parse_response`: the tokenizer's
    response template with the conversation so far as `prefix` and the tools' schemas typing the arguments; a stray
    EOS removed from the content, content always a string, tool calls validated. When parsing fails (malformed
    tool-call text), the turn is its decoded text without tool calls, as in TRL, and `malformed` is True (TRL counts
    nothing; we report it as `tools/malformed_frequency`)."""
    try:
        parsed = tokenizer.parse_response(list(ids), prefix=list(prefix), tools=list(tools) if tools else None)
        if parsed is None:
            raise ValueError("parse_response returned None")
        if isinstance(parsed.get("content"), str) and tokenizer.eos_token:
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            _validate_tool_calls(parsed["tool_calls"])
        return parsed, False
    except (ValueError, TypeError):
        return {"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)}, True


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]], chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None) -> list[int]:
    """TRL's `_get_tool_suffix_ids`: the tokens the tool messages (and the next assistant header) add after an
    assistant turn, as the difference between a minimal conversation rendered with and without them (the prefix cut
    after its last EOS: templates render `<|im_end|>\\n` after a turn, and the model's turn ends at the EOS).
    Example (Qwen3), a tool message with content 6:
    `\\n<|im_start|>user\\n<tool_response>\\n6\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kw = dict(chat_template_kwargs or {}, tokenize=True, return_dict=False, chat_template=chat_template)
    prefix = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **kw))
    full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, **kw))
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ConfigError("tools: the chat template is not prefix-preserving for tool messages (the EOS-trimmed "
                          "prefix ids are not a prefix of the full ids)")
    return full[len(prefix):]


# ------------------------------------------------------------------------------------------------ running calls


@dataclasses.dataclass(frozen=True)
class Call:
    """One tool call of one rollout: the model's parsed call (TRL's `{"type": "function", "function": {"name",
    "arguments"}}`), the rollout's tools, and whether the rollout's call limit still allows it."""

    row: int
    call: dict[str, Any]
    tools: dict[str, Tool] = dataclasses.field(compare=False)
    allowed: bool = True


@dataclasses.dataclass
class Result:
    """What a call returned to the model: the tool message's name and content (the result as TRL renders it: str()
    of it; an error as TRL reports one: `{'error': '...'}`), whether it failed and why, and its seconds."""

    name: str
    content: str
    failed: bool = False
    error: str | None = None  # "raised", "unknown", "timeout", "limit", "type", "unrenderable"
    seconds: float = 0.0


def _failure(name: str, message: str, kind: str, seconds: float = 0.0) -> Result:
    return Result(name, str({"error": message}), True, kind, seconds)


class ToolRunner:
    """Executes the tool calls of a generation batch at once: each sync call in a daemon thread (at most
    `max_workers` running), each async call on one event loop (a daemon thread), every call waited for at most
    `timeout` seconds. A call that raises, times out, names an unknown tool, is not a function call, exceeds its
    rollout's limit, or returns a value whose str() raises is reported to the model as TRL reports errors
    (`{'error': '...'}`) and counted as failed; nothing raises out of `run`. A timed-out sync call's thread is left
    to finish on its own (Python cannot stop a thread); it no longer counts against `max_workers`."""

    def __init__(self, timeout: float | None = 30.0, max_workers: int = 32) -> None:
        self.timeout = timeout
        self._slots = threading.Semaphore(max_workers)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rloo_jax-tools", daemon=True).start()
            self._loop = loop
        return self._loop

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def _start_sync(self, tool: Tool, arguments: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._slots.release()

        def work() -> None:
            t0 = time.perf_counter()
            try:
                value = tool.fn(**arguments)
            except BaseException as e:  # noqa: BLE001 - user code; reported to the model
                value = e
            finally:
                release()
            if not future.done():
                future.set_result((value, time.perf_counter() - t0))

        self._slots.acquire()
        future.release = release  # type: ignore[attr-defined]  # a timed-out call gives its slot back
        threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True).start()
        return future

    def _start_async(self, tool: Tool, arguments: Any) -> concurrent.futures.Future:
        async def work() -> tuple[Any, float]:
            t0 = time.perf_counter()
            try:
                coro = tool.fn(**arguments)
                value = await (coro if self.timeout is None else asyncio.wait_for(coro, self.timeout))
            except TimeoutError:
                value = TimeoutError()
            except BaseException as e:  # noqa: BLE001 - user code
                value = e
            return value, time.perf_counter() - t0

        return asyncio.run_coroutine_threadsafe(work(), self._event_loop())

    def run(self, calls: Sequence[Call]) -> list[Result]:
        """Every call's `Result`, in the order of `calls` (the caller orders a rollout's results as TRL does)."""
        started: list[tuple[str, Any]] = []  # (name, future or a Result already known)
        for c in calls:
            call = c.call
            if call.get("type") != "function":
                name = call.get("name", "unknown")
                started.append((name, _failure(name, f"Unsupported tool call type: {call.get('type')}", "type")))
                continue
            function = call["function"]
            name, arguments = function["name"], function.get("arguments") or {}
            tool = c.tools.get(name)
            if tool is None:
                started.append((name, _failure(name, f"Tool {name} not found.", "unknown")))
            elif not c.allowed:
                started.append((name, _failure(name, "Tool call limit of this rollout reached.", "limit")))
            elif not isinstance(arguments, dict):
                started.append((name, _failure(name, f"{name}() argument after ** must be a mapping, not "
                                                     f"{type(arguments).__name__}", "raised")))
            else:
                started.append((name, (self._start_async if tool.is_async else self._start_sync)(tool, arguments)))
        deadline = None if self.timeout is None else time.perf_counter() + self.timeout
        results = []
        for name, pending in started:
            if isinstance(pending, Result):
                results.append(pending)
                continue
            # every call started together: each waits at most `timeout` from the start of the batch
            left = None if deadline is None else max(deadline - time.perf_counter(), 0.0) + 0.05
            try:
                value, seconds = pending.result(timeout=left)
            except concurrent.futures.TimeoutError:
                getattr(pending, "release", lambda: None)()
                pending.cancel()
                results.append(_failure(name, f"Tool {name} timed out after {self.timeout:g} s", "timeout",
                                        float(self.timeout or 0.0)))
                continue
            results.append(_result(name, value, seconds, self.timeout))
        return results


def _result(name: str, value: Any, seconds: float, timeout: float | None) -> Result:
    """A finished call's `Result`: an exception as TRL's error (a timeout as ours), else str() of the value."""
    if isinstance(value, TimeoutError) and not str(value):
        return _failure(name, f"Tool {name} timed out after {timeout:g} s", "timeout", seconds)
    if isinstance(value, BaseException):
        return _failure(name, str(value), "raised", seconds)
    try:
        return Result(name, value if isinstance(value, str) else str(value), seconds=seconds)
    except Exception as e:  # noqa: BLE001 - a result that cannot be rendered
        return _failure(name, f"the result of {name} cannot be rendered as text ({type(e).__name__}: {e})",
                        "unrenderable", seconds)


# ------------------------------------------------------------------------------------------------ a run's tools


@dataclasses.dataclass
class ToolUse:
    """A run's tool calling: the standalone tools, the environments, the chat template conversations render with
    (None: the tokenizer's), the runner, and the limits (`rloo_jax.conversations` reads them)."""

    tokenizer: Any
    standalone: list[Tool]
    environments: EnvironmentPool | None
    chat_template: str | None
    chat_template_kwargs: dict | None
    runner: ToolRunner
    max_iterations: int | None
    max_calls: int | None
    batch_rows: int | None
    suffix_bucket: int
    max_model_len: int | None

    @property
    def prompt_tools(self) -> Any:
        """What each prompt is rendered with (`data.PromptEncoder.tools`): the tools' callables, or with
        environments {environment name: its callables}."""
        if self.environments is None:
            return [t.fn for t in self.standalone]
        return {name: [t.fn for t in tools] for name, tools in self.environments.tools.items()}

    def schemas(self, environment: Any = None) -> list[Callable]:
        """The callables whose schemas type a turn's parsed arguments (`parse_turn`'s tools): the rollout's."""
        if self.environments is None:
            return [t.fn for t in self.standalone]
        return [t.fn for t in self.environments.tools[environment]]

    def pause_at(self, rows: int) -> int:
        """Rows paused before the sampler returns to the host (`turns.start_turns`): tool_batch_rows, at most all."""
        return min(self.batch_rows or rows, rows)


def make_tool_use(cfg: Any, tokenizer: Any, tools: Sequence[Any] | None = None, environment_factory: Any = None,
                  max_model_len: int | None = None) -> ToolUse:
    """The run's `ToolUse` from its options (`cfg`: tools, environment_factory and the tool options; `tools` /
    `environment_factory`: the Python API's objects in their place) and the policy's tokenizer (checked and given
    a response template as TRL does: `prepare_chat`)."""
    specs = list(tools) if tools is not None else list(cfg.tools or [])
    standalone = [as_tool(t) for t in specs]
    factory = environment_factory if environment_factory is not None else cfg.environment_factory
    environments = EnvironmentPool(factory, standalone) if factory else None
    chat_template = prepare_chat(tokenizer)
    return ToolUse(tokenizer, standalone, environments, chat_template, cfg.chat_template_kwargs,
                   ToolRunner(cfg.tool_timeout, cfg.tool_workers), cfg.max_tool_calling_iterations,
                   cfg.max_tool_calls_per_rollout, cfg.tool_batch_rows, cfg.tool_suffix_bucket, max_model_len)
