"""ChatTTS: batched code generation built its prompt batch right-padded.

Citation: 2noise/ChatTTS commit e69ffac "fix(tokenizer): apply left padding"
(ChatTTS/model/tokenizer.py ``Tokenizer.encode``; the decode loop is ChatTTS/model/gpt.py
``GPT.generate`` / ``GPT._prepare_generation_inputs`` at e69ffac^).

The bug: ``Tokenizer.encode`` copied each prompt's ids and attention mask to the *start* of a
zero-filled (B, T) tensor, so a shorter prompt in the batch ended in pad slots (id 0, mask 0).
``GPT.generate`` then appends every new token after column T for all rows, builds position_ids from
``attention_mask.cumsum(-1) - 1`` and takes the next-token logits from the last column
(``logits.narrow(1, -1, 1)``), which for a shorter prompt is one of its pad slots.

The fix: ``encode`` copies each prompt to the *end* of the row (left padding), with its mask, so the
last column is always the prompt's own last token.

Ported at toy sizes with random weights: ChatTTS's GPT (transformers ``LlamaModel`` without
``embed_tokens``, ``emb_text`` / ``emb_code`` / weight-normed ``head_code`` for num_vq codebooks),
its ``_infer_code`` prompt layout ``[Stts][empty_spk]...[Ptts]`` and its own KV-cached decode loop.
The BertTokenizerFast that ChatTTS torch.load's is replaced by a tiny character tokenizer with the
same ``encode_plus`` call. Streaming, tqdm, attention/hidden returns, logits warpers/processors and
the "regenerate if empty" retry are left out; the temperature is set very low so that sampling is
effectively greedy, and min_new_token=2 keeps a row from stopping at once.
"""

import sys
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as P
from torch.nn.utils.parametrizations import weight_norm
from transformers import LlamaConfig, LlamaModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=FutureWarning)

FIXED = "--fixed" in sys.argv


def del_all(d: Union[dict, list]):
    if isinstance(d, dict):
        lst = list(d.keys())
        for k in lst:
            x = d.pop(k)
            if isinstance(x, (dict, list)):
                del_all(x)
            del x
    elif isinstance(d, list):
        while len(d):
            x = d.pop()
            if isinstance(x, (dict, list)):
                del_all(x)
            del x
    else:
        del d


# ---- stand-in for the torch.load'ed BertTokenizerFast -------------------------------------------
class _CharTokenizer:
    SPECIALS = ["[PAD]", "[Stts]", "[empty_spk]", "[spk_emb]", "[Ptts]", "[Sbreak]", "[Pbreak]",
                "[Ebreak]", "[break_0]", "[speed_5]"]

    def __init__(self):
        chars = "abcdefghijklmnopqrstuvwxyz ,."
        self.vocab = {t: i for i, t in enumerate(self.SPECIALS + list(chars))}

    def __len__(self):
        return len(self.vocab)

    def convert_tokens_to_ids(self, tok):
        return self.vocab[tok]

    def _split(self, text: str) -> List[str]:
        out, i = [], 0
        while i < len(text):
            if text[i] == "[":
                j = text.index("]", i)
                out.append(text[i:j + 1])
                i = j + 1
            else:
                out.append(text[i])
                i += 1
        return out

    def encode_plus(self, text, return_tensors="pt", add_special_tokens=False, padding=True):
        ids = torch.tensor([[self.vocab[t] for t in self._split(text)]], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# ---- ChatTTS/model/tokenizer.py -------------------------------------------------------------------
class Tokenizer:
    def __init__(self, tokenizer: _CharTokenizer):
        self._tokenizer = tokenizer
        self.len = len(tokenizer)
        self.spk_emb_ids = tokenizer.convert_tokens_to_ids("[spk_emb]")
        self.break_0_ids = tokenizer.convert_tokens_to_ids("[break_0]")
        self.eos_token = tokenizer.convert_tokens_to_ids("[Ebreak]")

    @torch.inference_mode()
    def encode(
        self, text: List[str], num_vq: int, device="cpu"
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:

        input_ids_lst = []
        attention_mask_lst = []
        max_input_ids_len = -1
        max_attention_mask_len = -1
        # avoid random speaker embedding of tokenizer in the other dims
        for t in text:
            x = self._tokenizer.encode_plus(
                t, return_tensors="pt", add_special_tokens=False, padding=True
            )
            input_ids_lst.append(x["input_ids"].squeeze_(0))
            attention_mask_lst.append(x["attention_mask"].squeeze_(0))
            del_all(x)
            ids_sz = input_ids_lst[-1].size(0)
            if ids_sz > max_input_ids_len:
                max_input_ids_len = ids_sz
            attn_sz = attention_mask_lst[-1].size(0)
            if attn_sz > max_attention_mask_len:
                max_attention_mask_len = attn_sz
        input_ids = torch.zeros(
            len(input_ids_lst),
            max_input_ids_len,
            device=device,
            dtype=input_ids_lst[0].dtype,
        )
        for i in range(len(input_ids_lst)):
            if FIXED:
                input_ids.narrow(0, i, 1).narrow(
                    1,
                    max_input_ids_len - input_ids_lst[i].size(0),
                    input_ids_lst[i].size(0),
                ).copy_(input_ids_lst[i])  # left padding
            else:
                input_ids.narrow(0, i, 1).narrow(1, 0, input_ids_lst[i].size(0)).copy_(
                    input_ids_lst[i]
                )
        del_all(input_ids_lst)
        attention_mask = torch.zeros(
            len(attention_mask_lst),
            max_attention_mask_len,
            device=device,
            dtype=attention_mask_lst[0].dtype,
        )
        for i in range(len(attention_mask_lst)):
            if FIXED:
                attn = attention_mask.narrow(0, i, 1)
                attn.narrow(
                    1,
                    max_attention_mask_len - attention_mask_lst[i].size(0),
                    attention_mask_lst[i].size(0),
                ).copy_(attention_mask_lst[i])  # left padding
            else:
                attention_mask.narrow(0, i, 1).narrow(
                    1, 0, attention_mask_lst[i].size(0)
                ).copy_(attention_mask_lst[i])
        del_all(attention_mask_lst)

        text_mask = torch.ones(input_ids.shape, dtype=bool, device=device)
        input_ids = input_ids.unsqueeze_(-1).expand(-1, -1, num_vq)

        return input_ids, attention_mask, text_mask


# ---- ChatTTS/model/gpt.py -------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(
        self,
        gpt_config: dict,
        num_audio_tokens: int = 626,
        num_text_tokens: int = 21178,
        num_vq=4,
        device=torch.device("cpu"),
    ):
        super().__init__()

        self.device = device
        self.device_gpt = device if "mps" not in str(device) else torch.device("cpu")

        self.num_vq = num_vq
        self.num_audio_tokens = num_audio_tokens

        self.gpt = self._build_llama(gpt_config, self.device_gpt)
        self.model_dim = int(self.gpt.config.hidden_size)
        self.emb_code = nn.ModuleList(
            [
                nn.Embedding(num_audio_tokens, self.model_dim, device=self.device_gpt)
                for _ in range(num_vq)
            ],
        )
        self.emb_text = nn.Embedding(num_text_tokens, self.model_dim, device=self.device_gpt)

        self.head_text = weight_norm(
            nn.Linear(self.model_dim, num_text_tokens, bias=False, device=device),
            name="weight",
        )
        self.head_code = nn.ModuleList(
            [
                weight_norm(
                    nn.Linear(self.model_dim, num_audio_tokens, bias=False, device=device),
                    name="weight",
                )
                for _ in range(self.num_vq)
            ],
        )

    def _build_llama(self, config: dict, device: torch.device) -> LlamaModel:
        llama_config = LlamaConfig(**config)
        model = LlamaModel(llama_config)
        del model.embed_tokens
        return model.to(device)

    def forward(self, input_ids: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """
        get_emb
        """
        emb_text: torch.Tensor = self.emb_text(
            input_ids[text_mask].narrow(1, 0, 1).squeeze_(1).to(self.device_gpt)
        )

        text_mask_inv = text_mask.logical_not().to(self.device_gpt)
        masked_input_ids: torch.Tensor = input_ids[text_mask_inv].to(self.device_gpt)

        emb_code = [self.emb_code[i](masked_input_ids[:, i]) for i in range(self.num_vq)]
        emb_code = torch.stack(emb_code, 2).sum(2)

        emb = torch.zeros(
            (input_ids.shape[:-1]) + (emb_text.shape[-1],),
            device=emb_text.device,
            dtype=emb_text.dtype,
        )
        emb[text_mask] = emb_text
        emb[text_mask_inv] = emb_code.to(emb.dtype)

        del emb_text, emb_code, text_mask_inv

        return emb

    @dataclass(repr=False, eq=False)
    class _GenerationInputs:
        position_ids: torch.Tensor
        cache_position: torch.Tensor
        use_cache: bool
        input_ids: Optional[torch.Tensor] = None
        past_key_values: Optional[Tuple[Tuple[torch.FloatTensor]]] = None
        attention_mask: Optional[torch.Tensor] = None
        inputs_embeds: Optional[torch.Tensor] = None

        def to(self, device: torch.device, dtype: torch.dtype):
            if self.attention_mask is not None:
                self.attention_mask = self.attention_mask.to(device, dtype=dtype)
            if self.position_ids is not None:
                self.position_ids = self.position_ids.to(device, dtype=dtype)
            if self.inputs_embeds is not None:
                self.inputs_embeds = self.inputs_embeds.to(device, dtype=dtype)
            if self.cache_position is not None:
                self.cache_position = self.cache_position.to(device, dtype=dtype)

    def _prepare_generation_inputs(
        self,
        input_ids: torch.Tensor,
        past_key_values: Optional[Tuple[Tuple[torch.FloatTensor]]] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        cache_position: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        use_cache=True,
    ) -> _GenerationInputs:
        has_static_cache = False
        if past_key_values is None:
            past_key_values = getattr(self.gpt.layers[0].self_attn, "past_key_value", None)
            has_static_cache = past_key_values is not None

        past_length = 0
        if past_key_values is not None:
            if isinstance(past_key_values, Cache):
                past_length = (
                    int(cache_position[0])
                    if cache_position is not None
                    else past_key_values.get_seq_length()
                )
                max_cache_length = past_key_values.get_max_length()
                if max_cache_length is not None and max_cache_length < 0:
                    max_cache_length = None  # installed transformers: -1 means "dynamic"
                cache_length = (
                    past_length
                    if max_cache_length is None
                    else min(max_cache_length, past_length)
                )
            else:
                cache_length = past_length = past_key_values[0][0].shape[2]
                max_cache_length = None

            # Keep only the unprocessed tokens
            if attention_mask is not None and attention_mask.shape[1] > input_ids.shape[1]:
                start = -(attention_mask.shape[1] - past_length)
                input_ids = input_ids.narrow(1, start, -start)
            elif past_length < input_ids.shape[1]:
                input_ids = input_ids.narrow(1, past_length, input_ids.size(1) - past_length)

            if (
                max_cache_length is not None
                and attention_mask is not None
                and cache_length + input_ids.shape[1] > max_cache_length
            ):
                attention_mask = attention_mask.narrow(1, -max_cache_length, max_cache_length)

        if attention_mask is not None and position_ids is None:
            # create position_ids on the fly for batch generation
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask.eq(0), 1)
            if past_key_values:
                position_ids = position_ids.narrow(1, -input_ids.shape[1], input_ids.shape[1])

        input_length = position_ids.shape[-1] if position_ids is not None else input_ids.shape[-1]
        if cache_position is None:
            cache_position = torch.arange(
                past_length, past_length + input_length, device=input_ids.device
            )
        else:
            cache_position = cache_position.narrow(0, -input_length, input_length)

        if has_static_cache:
            past_key_values = None

        model_inputs = self._GenerationInputs(
            position_ids=position_ids,
            cache_position=cache_position,
            use_cache=use_cache,
        )

        # if `inputs_embeds` are passed, we only want to use them in the 1st generation step
        if inputs_embeds is not None and past_key_values is None:
            model_inputs.inputs_embeds = inputs_embeds
        else:
            model_inputs.input_ids = input_ids.contiguous()

        model_inputs.past_key_values = past_key_values
        model_inputs.attention_mask = attention_mask

        return model_inputs

    @torch.no_grad()
    def generate(
        self,
        emb: torch.Tensor,
        inputs_ids: torch.Tensor,
        temperature: torch.Tensor,
        eos_token: Union[int, torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        max_new_token=2048,
        min_new_token=0,
        infer_text=False,
    ):
        start_idx, end_idx = inputs_ids.shape[1], torch.zeros(
            inputs_ids.shape[0], device=inputs_ids.device, dtype=torch.long
        )
        finish = torch.zeros(inputs_ids.shape[0], device=inputs_ids.device).bool()

        temperature = (
            temperature.unsqueeze(0).expand(inputs_ids.shape[0], -1).contiguous().view(-1, 1)
        )

        attention_mask_cache = torch.ones(
            (inputs_ids.shape[0], inputs_ids.shape[1] + max_new_token),
            dtype=torch.bool,
            device=inputs_ids.device,
        )
        if attention_mask is not None:
            attention_mask_cache.narrow(1, 0, attention_mask.shape[1]).copy_(attention_mask)

        past_key_values = None

        for i in range(max_new_token):
            model_input = self._prepare_generation_inputs(
                inputs_ids,
                past_key_values,
                attention_mask_cache.narrow(1, 0, inputs_ids.shape[1]),
                use_cache=True,
            )

            if i > 0:
                del emb
                inputs_ids_emb = model_input.input_ids.to(self.device_gpt)
                if infer_text:
                    emb: torch.Tensor = self.emb_text(inputs_ids_emb[:, :, 0])
                else:
                    code_emb = [
                        self.emb_code[i](inputs_ids_emb[:, :, i]) for i in range(self.num_vq)
                    ]
                    emb = torch.stack(code_emb, 3).sum(3)
                del inputs_ids_emb, model_input.input_ids
            model_input.inputs_embeds = emb

            model_input.to(self.device_gpt, self.gpt.dtype)

            outputs: BaseModelOutputWithPast = self.gpt(
                attention_mask=model_input.attention_mask,
                position_ids=model_input.position_ids,
                past_key_values=model_input.past_key_values,
                inputs_embeds=model_input.inputs_embeds,
                use_cache=model_input.use_cache,
                cache_position=model_input.cache_position,
            )
            hidden_states = outputs.last_hidden_state.to(self.device, dtype=torch.float)
            past_key_values = outputs.past_key_values

            with P.cached():
                if infer_text:
                    logits: torch.Tensor = self.head_text(hidden_states)
                else:
                    logits = torch.empty(
                        hidden_states.size(0),
                        hidden_states.size(1),
                        self.num_audio_tokens,
                        self.num_vq,
                        dtype=torch.float,
                        device=self.device,
                    )
                    for num_vq_iter in range(self.num_vq):
                        x: torch.Tensor = self.head_code[num_vq_iter](hidden_states)
                        logits[..., num_vq_iter] = x
                        del x

            del hidden_states

            # logits = logits[:, -1].float()
            logits = logits.narrow(1, -1, 1).squeeze_(1).float()

            if not infer_text:
                logits = logits.permute(0, 2, 1)
                logits = logits.reshape(-1, logits.size(2))

            logits /= temperature

            if i < min_new_token:
                logits[:, eos_token] = -torch.inf

            scores = F.softmax(logits, dim=-1)
            del logits

            idx_next = torch.multinomial(scores, num_samples=1).to(finish.device)
            del scores

            if not infer_text:
                idx_next = idx_next.view(-1, self.num_vq)
                finish_or = idx_next.eq(eos_token).any(1)
                finish.logical_or_(finish_or)
                del finish_or
                inputs_ids_tmp = torch.cat([inputs_ids, idx_next.unsqueeze_(1)], 1)
            else:
                finish_or = idx_next.eq(eos_token).any(1)
                finish.logical_or_(finish_or)
                del finish_or
                inputs_ids_tmp = torch.cat(
                    [inputs_ids, idx_next.unsqueeze_(-1).expand(-1, -1, self.num_vq)], 1
                )

            del inputs_ids
            inputs_ids = inputs_ids_tmp
            del inputs_ids_tmp, idx_next

            not_finished = finish.logical_not().to(end_idx.device)
            end_idx.add_(not_finished.int())
            del not_finished

            if finish.all():
                break

        return [inputs_ids[idx].narrow(0, start_idx, n) for idx, n in enumerate(end_idx)]


# ---- ChatTTS/core.py Chat._infer_code (trimmed) ---------------------------------------------------
@torch.inference_mode()
def infer_code(gpt: GPT, tokenizer: Tokenizer, text: List[str], prompt="[speed_5]",
               temperature=1e-4, max_new_token=6, min_new_token=2):
    temperature = [temperature] * gpt.num_vq
    text = [prompt + t for t in text]
    text = [f"[Stts][empty_spk]{t}[Ptts]" for t in text]

    input_ids, attention_mask, text_mask = tokenizer.encode(text, gpt.num_vq, gpt.device_gpt)
    emb = gpt(input_ids, text_mask)
    del text_mask

    num_code = int(gpt.emb_code[0].num_embeddings - 1)
    return gpt.generate(
        emb,
        input_ids,
        temperature=torch.tensor(temperature, device=gpt.device),
        eos_token=num_code,
        attention_mask=attention_mask,
        max_new_token=max_new_token,
        min_new_token=min_new_token,
        infer_text=False,
    )


def main():
    torch.manual_seed(0)
    tok = Tokenizer(_CharTokenizer())
    gpt_config = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=256,
        vocab_size=tok.len,
        initializer_range=0.2,
    )
    gpt = GPT(gpt_config, num_audio_tokens=33, num_text_tokens=tok.len, num_vq=4).eval()

    texts = ["hello there, how are you today.", "hi."]
    torch.manual_seed(1)
    codes = infer_code(gpt, tok, texts)
    for t, c in zip(texts, codes):
        print(f"{t!r}: {c.tolist()}")


if __name__ == "__main__":
    main()
