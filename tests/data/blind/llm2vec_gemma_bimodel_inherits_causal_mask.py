"""LLM2Vec's bidirectional Gemma: GemmaBiModel kept GemmaModel's own mask building.

Citation: McGill-NLP/llm2vec commit c62c2f0 ("fix _update_causal_mask for gemma modeling"),
llm2vec/models/bidirectional_gemma.py (GemmaBiModel) + llm2vec/llm2vec.py (LLM2Vec.forward,
get_pooling "mean", left padding, embed_mask that leaves the instruction out).

The bug: GemmaBiModel swapped in ModifiedGemma*Attention layers with ``self.is_causal = False``
but did not override ``_update_causal_mask``, so the inherited GemmaModel mask (the causal
triangle plus padding) was still built and handed to every layer: the "bidirectional" embedder
ran causally on every padded batch.

The fix: GemmaBiModel gets its own ``_update_causal_mask`` that starts from zeros instead of a
min_dtype triangle, so the mask only blocks padded keys.

Ported at toy sizes with random weights on transformers 5, where GemmaModel.forward builds its
mask with create_causal_mask instead of calling ``self._update_causal_mask``: the fixed
GemmaBiModel calls the fix's ``_update_causal_mask`` itself and hands the 4D mask it makes to
GemmaModel.forward (a 4D mask is passed through as it is).
"""

import sys

import torch
from torch import nn
from transformers import GemmaConfig, GemmaModel
from transformers.cache_utils import Cache, StaticCache
from transformers.models.gemma.modeling_gemma import (
    GemmaAttention,
    GemmaDecoderLayer,
    GemmaMLP,
    GemmaRMSNorm,
)

FIXED = "--fixed" in sys.argv


class ModifiedGemmaAttention(GemmaAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_causal = False


class ModifiedGemmaDecoderLayer(GemmaDecoderLayer):
    def __init__(self, config: GemmaConfig, layer_idx: int):
        nn.Module.__init__(self)
        self.config = config
        self.hidden_size = config.hidden_size

        self.self_attn = ModifiedGemmaAttention(config=config, layer_idx=layer_idx)

        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GemmaBiModel(GemmaModel):
    _no_split_modules = ["ModifiedGemmaDecoderLayer"]

    def __init__(self, config: GemmaConfig):
        GemmaModel.__init__(self, config)
        self.layers = nn.ModuleList(
            [ModifiedGemmaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.post_init()

    if FIXED:

        def _update_causal_mask(
            self,
            attention_mask: torch.Tensor,
            input_tensor: torch.Tensor,
            cache_position: torch.Tensor,
            past_key_values: Cache,
            output_attentions: bool,
        ):
            if self.config._attn_implementation == "flash_attention_2":
                if attention_mask is not None and 0.0 in attention_mask:
                    return attention_mask
                return None

            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            using_static_cache = isinstance(past_key_values, StaticCache)

            dtype, device = input_tensor.dtype, input_tensor.device
            min_dtype = torch.finfo(dtype).min
            sequence_length = input_tensor.shape[1]
            if using_static_cache:
                target_length = past_key_values.get_max_cache_shape()
            else:
                target_length = (
                    attention_mask.shape[-1]
                    if isinstance(attention_mask, torch.Tensor)
                    else past_seen_tokens + sequence_length + 1
                )

            if attention_mask is not None and attention_mask.dim() == 4:
                if attention_mask.max() != 0:
                    raise ValueError("Custom 4D attention mask should be passed in inverted form with max==0`")
                causal_mask = attention_mask
            else:
                causal_mask = torch.zeros((sequence_length, target_length), dtype=dtype, device=device)
                causal_mask *= torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
                causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1)
                if attention_mask is not None:
                    causal_mask = causal_mask.clone()
                    mask_length = attention_mask.shape[-1]
                    padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
                    padding_mask = padding_mask == 0
                    causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                        padding_mask, min_dtype
                    )
            return causal_mask

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            cache_position = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
            causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, None, False)
            return super().forward(inputs_embeds=inputs_embeds, attention_mask=causal_mask, **kwargs)


class LLM2Vec(nn.Module):
    def __init__(self, model, pooling_mode="mean", skip_instruction=True, padding_side="left"):
        super().__init__()
        self.model = model
        self.pooling_mode = pooling_mode
        self.skip_instruction = skip_instruction
        self.padding_side = padding_side

    def _skip_instruction(self, sentence_feature):
        assert sentence_feature["attention_mask"].shape == sentence_feature["embed_mask"].shape
        sentence_feature["attention_mask"] = sentence_feature["embed_mask"]

    def forward(self, sentence_feature):
        embed_mask = None
        if "embed_mask" in sentence_feature:
            embed_mask = sentence_feature.pop("embed_mask")
        reps = self.model(**sentence_feature)
        sentence_feature["embed_mask"] = embed_mask

        return self.get_pooling(sentence_feature, reps.last_hidden_state)

    def get_pooling(self, features, last_hidden_states):  # All models padded from left
        assert self.padding_side == "left", "Pooling modes are implemented for padding from left."
        if self.skip_instruction:
            self._skip_instruction(features)
        seq_lengths = features["attention_mask"].sum(dim=-1)
        if self.pooling_mode == "mean":
            return torch.stack(
                [last_hidden_states[i, -length:, :].mean(dim=0) for i, length in enumerate(seq_lengths)],
                dim=0,
            )
        raise ValueError(f"{self.pooling_mode} is not implemented yet.")


def main():
    torch.manual_seed(0)
    config = GemmaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    model = GemmaBiModel(config).eval()
    l2v = LLM2Vec(model, pooling_mode="mean", skip_instruction=True)

    # "instruction !@#$%^&*() text" tokenized with padding_side="left": the instruction's tokens
    # are in attention_mask but not in embed_mask.
    instr = [[2, 17, 23, 41], [2, 17, 23, 41]]
    texts = [[55, 61, 70, 88, 93, 101], [55, 64, 99]]
    rows = [i + t for i, t in zip(instr, texts)]
    L = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), L, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), L, dtype=torch.long)
    embed_mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, (r, t) in enumerate(zip(rows, texts)):
        input_ids[b, L - len(r):] = torch.tensor(r)
        attention_mask[b, L - len(r):] = 1
        embed_mask[b, L - len(t):] = 1

    features = {"input_ids": input_ids, "attention_mask": attention_mask, "embed_mask": embed_mask}
    with torch.no_grad():
        reps = l2v(features)
    reps = torch.nn.functional.normalize(reps, p=2, dim=-1)
    print("embeddings[:, :6]:")
    print(reps[:, :6])
    print("cosine(text 0, text 1):", float(reps[0] @ reps[1]))


if __name__ == "__main__":
    main()
