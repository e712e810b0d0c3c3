# vllm-project/vllm#47772 ("[Bugfix][Pooling] Align CrossEncoder token type ids after truncation", merged).
#
# vLLM's cross-encoder scoring (LLM.score / /score / /rerank) tokenizes the (query, document) pair, then
# applies the request's post-tokenization truncation (truncate_prompt_tokens, truncation_side="left") to
# prompt_token_ids, and compresses token_type_ids to one integer: the index of the first 1 (the start of
# the document segment). The GPU model runner rebuilds token_type_ids as arange(seq_len) >= that index.
# Before the fix, CrossEncoderIOProcessor.render compressed the *untruncated* token_type_ids, so after a
# left truncation the split still pointed at the old query/document boundary: kept document tokens at the
# head of the prompt were embedded as segment 0 (query). The fix runs the same truncation/padding over
# token_type_ids (_apply_post_tokenization_to_token_type_ids) before compressing them.
#
# Ported from vllm/entrypoints/pooling/scoring/io_processor.py (CrossEncoderIOProcessor.render,
# get_score_prompt, _apply_post_tokenization_to_token_type_ids), scoring/utils.py (compress_token_type_ids),
# vllm/v1/worker/gpu_model_runner.py (_init_model_kwargs); model: a tiny BertForSequenceClassification
# (the cross-encoder/ms-marco-MiniLM layout, num_labels=1, sigmoid activation).
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

FIXED = "--fixed" in sys.argv

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "a", "cat", "the", "small",
         "animal", "that", "purrs", "and", "sleeps", "all", "day", "long", "dog", "barks", "on", "mat"]


@dataclass
class TokenizeParams:
    max_input_tokens: int = 512
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    pad_prompt_tokens: int | None = None

    def get_encode_kwargs(self):
        return {}

    def apply_post_tokenization(self, tokenizer, engine_prompt):
        ids = engine_prompt["prompt_token_ids"]
        max_length = self.truncate_prompt_tokens
        if max_length is not None and max_length < 0:
            max_length = self.max_input_tokens
        if max_length is None or max_length >= len(ids):
            return
        side = self.truncation_side or tokenizer.truncation_side
        if side == "left":
            engine_prompt["prompt_token_ids"] = ids[-max_length:]
        else:
            engine_prompt["prompt_token_ids"] = ids[:max_length]


@dataclass
class PoolingParams:
    extra_kwargs: dict[str, Any] | None = None

    def clone(self):
        return PoolingParams(extra_kwargs=dict(self.extra_kwargs) if self.extra_kwargs else None)


def compress_token_type_ids(token_type_ids: list[int]) -> int:
    """
    Return position of the first 1 or the length of the list
    if not found.
    """
    first_one = len(token_type_ids)
    err_msg = (
        "Token type ids are expected to be a sequence"
        " of zeros followed by a sequence of ones"
    )
    for i, type_id in enumerate(token_type_ids):
        if type_id == 0 and first_one < i:
            raise ValueError(err_msg)
        elif type_id == 1 and first_one > i:
            first_one = i
        elif type_id > 1:
            raise ValueError(err_msg)

    return first_one


def _apply_post_tokenization_to_token_type_ids(tokenizer, tok_params, token_type_ids):
    pad_length = tok_params.pad_prompt_tokens
    if pad_length is not None and pad_length < 0:
        pad_length = tok_params.max_input_tokens

    if pad_length is not None and pad_length > len(token_type_ids):
        pad_token_type_id = token_type_ids[-1] if token_type_ids else 0
        token_type_ids = token_type_ids + [pad_token_type_id] * (pad_length - len(token_type_ids))

    max_length = tok_params.truncate_prompt_tokens
    if max_length is not None and max_length < 0:
        max_length = tok_params.max_input_tokens

    if max_length is None or max_length >= len(token_type_ids):
        return token_type_ids
    if max_length == 0:
        return token_type_ids[:0]

    side = tok_params.truncation_side or (tokenizer.truncation_side if tokenizer is not None else None)
    if side == "left":
        return token_type_ids[-max_length:]

    return token_type_ids[:max_length]


class CrossEncoderIOProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_score_prompt(self, data_1, data_2, encode_kwargs):
        prompt_inputs = self.tokenizer(text=data_1, text_pair=data_2, **encode_kwargs)
        full_prompt = self.tokenizer.decode(prompt_inputs["input_ids"])
        engine_prompt = {"prompt_token_ids": prompt_inputs["input_ids"]}
        if (token_type_ids := prompt_inputs.get("token_type_ids")) is not None:
            engine_prompt["token_type_ids"] = token_type_ids
        return full_prompt, engine_prompt

    def render(self, render_params):
        tok_params = render_params["tok_params"]
        params = render_params["params"]
        _, engine_prompt = self.get_score_prompt(
            data_1=render_params["data_1"],
            data_2=render_params["data_2"],
            encode_kwargs=tok_params.get_encode_kwargs(),
        )

        tok_params.apply_post_tokenization(self.tokenizer, engine_prompt)

        if token_type_ids := engine_prompt.pop("token_type_ids", None):
            params = params.clone()
            if FIXED:
                compressed = compress_token_type_ids(
                    _apply_post_tokenization_to_token_type_ids(self.tokenizer, tok_params, token_type_ids)
                )
            else:
                compressed = compress_token_type_ids(token_type_ids)
            params.extra_kwargs = {**(params.extra_kwargs or {}), "compressed_token_type_ids": compressed}

        return engine_prompt, params


@dataclass
class InputBatch:
    prompts: list = field(default_factory=list)
    pooling_params: list = field(default_factory=list)

    @property
    def num_reqs(self):
        return len(self.prompts)

    def get_pooling_params(self):
        return self.pooling_params


class GPUModelRunner:
    def __init__(self, model):
        self.model = model
        self.is_pooling_model = True
        self.input_batch = InputBatch()

    def _init_model_kwargs(self):
        model_kwargs = dict[str, Any]()

        if not self.is_pooling_model:
            return model_kwargs

        num_reqs = self.input_batch.num_reqs
        pooling_params = self.input_batch.get_pooling_params()

        token_type_id_requests = dict[int, Any]()
        for i, param in enumerate(pooling_params):
            if (
                param.extra_kwargs is not None
                and (token_types := param.extra_kwargs.get("compressed_token_type_ids")) is not None
            ):
                token_type_id_requests[i] = token_types

        if len(token_type_id_requests) == 0:
            return model_kwargs

        seq_lens = self.seq_lens[:num_reqs]
        token_type_ids = []

        for i in range(num_reqs):
            pos = token_type_id_requests.get(i, seq_lens[i])
            ids = (torch.arange(seq_lens[i]) >= pos).int()
            token_type_ids.append(ids)

        model_kwargs["token_type_ids"] = torch.concat(token_type_ids)
        return model_kwargs

    @torch.no_grad()
    def execute_model(self):
        prompts = self.input_batch.prompts
        self.seq_lens = torch.tensor([len(p["prompt_token_ids"]) for p in prompts])
        input_ids = torch.tensor([t for p in prompts for t in p["prompt_token_ids"]])
        positions = torch.cat([torch.arange(int(n)) for n in self.seq_lens])
        model_kwargs = self._init_model_kwargs()
        token_type_ids = model_kwargs.get("token_type_ids", torch.zeros_like(input_ids))

        # varlen: each request attends only within itself; the classify pooler reads each request's [CLS]
        scores = []
        start = 0
        for n in self.seq_lens.tolist():
            out = self.model(
                input_ids=input_ids[None, start:start + n],
                token_type_ids=token_type_ids[None, start:start + n].long(),
                position_ids=positions[None, start:start + n],
            )
            scores.append(torch.sigmoid(out.logits[0, 0]).item())
            start += n
        return scores


def main():
    torch.manual_seed(0)
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})
    config = BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, num_labels=1)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight.normal_(0.0, 1.0)

    io = CrossEncoderIOProcessor(tokenizer)
    runner = GPUModelRunner(model)

    query = "what is a cat"
    documents = [
        "the small animal that purrs and sleeps all day long on the mat",
        "a dog barks",
    ]
    tok_params = TokenizeParams(truncate_prompt_tokens=12, truncation_side="left")
    for doc in documents:
        engine_prompt, params = io.render(
            {"data_1": query, "data_2": doc, "tok_params": tok_params, "params": PoolingParams()}
        )
        runner.input_batch.prompts.append(engine_prompt)
        runner.input_batch.pooling_params.append(params)

    scores = runner.execute_model()
    for doc, p, s in zip(documents, runner.input_batch.pooling_params, scores):
        print(f"split={p.extra_kwargs['compressed_token_type_ids']:2d} score={s:.6f}  {doc!r}")


if __name__ == "__main__":
    main()
