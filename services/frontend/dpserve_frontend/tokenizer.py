"""The model's tokenizer and chat template, built from the `ModelInfo` the engines publish (no model files).

A request's tools go to the template as `tools=` (Hugging Face's convention). A template that never reads `tools`
(SmolLM2's) would drop them silently: for it, the conversation is written in the Hermes format first (hermes.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dpserve_shared.schema import ModelInfo

from dpserve_frontend import hermes
from dpserve_frontend.errors import BadRequest


class ChatTemplateError(BadRequest):
    pass


def _raise_exception(message: str):
    # transformers' templates call raise_exception("...") to reject a conversation.
    raise ChatTemplateError(f"chat template error: {message}")


class ModelTokenizer:
    """Encode / decode / chat template for one model. Built once per ModelInfo; the template is compiled once."""

    def __init__(self, info: ModelInfo):
        self.info = info
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self.vocab_size = max(info.vocab_size, self.tokenizer.get_vocab_size(with_added_tokens=True))
        self._template = None
        self.template_reads_tools = False
        if info.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(info.chat_template)
            self.template_reads_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(info.chat_template))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.info.bos_token_id
        if add_special_tokens and self.info.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one tokenizer per model, lives as long as the process)
    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included, partial UTF-8 as U+FFFD)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self._template is None:
            raise ChatTemplateError(
                f"model {self.info.name!r} has no chat template (a base model): use /v1/completions, or start the "
                "server with --chat-template FILE to give it one"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.info.bos_token or "",
                eos_token=self.info.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, KeyError, ValueError) as e:
            raise ChatTemplateError(f"the messages do not fit the model's chat template: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool,
                    add_special_tokens: bool, chat_template_kwargs: dict | None,
                    tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """The prompt text and ids for a conversation (chat completions and /tokenize, so the counts agree), with
        `tools` (OpenAI's tool objects) for the model to call."""
        if continue_final_message and add_generation_prompt:
            raise BadRequest("continue_final_message and add_generation_prompt cannot both be true",
                             param="continue_final_message")
        kwargs = dict(chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools"):
            kwargs.pop(reserved, None)
        if not self.template_reads_tools:
            messages = hermes.render_messages(messages, tools)
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        if continue_final_message:
            # Leave the last message open: cut the rendered text right after its content.
            last = messages[-1]["content"]
            end = text.rfind(last) if last else -1
            if end < 0:
                raise BadRequest("continue_final_message: the final message's content is not in the rendered "
                                 "prompt", param="continue_final_message")
            text = text[: end + len(last)]
        return text, self.encode(text, add_special_tokens=add_special_tokens)
