# PaddleMIX VisualGLM (PaddlePaddle/PaddleMIX commit fad8c3bc, "fix visualglm attention_mask";
# paddlemix/models/visualglm/modeling.py and paddlemix/processors/visualglm_processing.py read at fad8c3bc^ and
# fad8c3bc), on PaddleNLP's ChatGLM (paddlenlp/transformers/chatglm/modeling.py, the snapshot whose 4-D mask is
# True = attend, as the fix's mask is) and its GenerationMixin (paddlenlp/generation/utils.py), ported to torch.
# Bug: the processor returns input_ids / pre_image_length / pixel_values and no attention mask, and
# VisualGLMForConditionalGeneration.generate hands attention_mask=None to language_model.generate. The generation
# mixin then fills in its default, prepare_attention_mask_for_generation: a float zeros [b, 1, 1, s] (an additive
# "nothing masked"). ChatGLMModel casts that to bool, so every key is False (= masked) and gets finfo.min: the
# prefill of the image + question attends all positions alike, and each decode row (grown by
# update_model_kwargs_for_generation) keeps only the generated tokens.
# Fix: generate builds the GLM mask itself, `attention_mask = self.language_model.get_masks(input_ids)`: the context
# before <bos> is seen by every token both ways, the rest is causal (int64, 1 = attend).
# The EVA-CLIP vision tower and Q-Former are a stand-in (random query outputs through language_projection); the
# tokenizer is a stand-in (ids given directly); the model has 4 query tokens instead of 32 and tiny sizes; the
# repetition-penalty processor is left out; decode_strategy "sampling" with top_k=1 as run_predict.py sets it.
import math
import sys
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv

DEFAULT_DTYPE = torch.float16  # VisualGLMForConditionalGeneration.from_pretrained(..., dtype="float16")
NUM_QUERY_TOKENS = 4           # 32 in VisualGLM


class ChatGLMConfig:
    def __init__(self, **kwargs):
        self.vocab_size = 64
        self.hidden_size = 32
        self.num_attention_heads = 4
        self.num_hidden_layers = 2
        self.layernorm_epsilon = 1e-5
        self.inner_hidden_size = 64
        self.max_sequence_length = 64
        self.position_encoding_2d = True
        self.attention_scale = True
        self.activation = "gelu"
        self.pre_seq_len = None
        self.prefix_projection = False
        self.use_cache = True
        self.tensor_parallel_degree = 1
        self.is_encoder_decoder = False
        self.unk_token_id = 0
        self.pad_token_id = 3
        self.mask_token_id = 59
        self.gmask_token_id = 60
        self.bos_token_id = 61
        self.eos_token_id = 62
        self.use_return_dict = False
        for k, v in kwargs.items():
            setattr(self, k, v)


# ----------------------------------------------------------------------------- paddlenlp/transformers/chatglm/modeling.py
class RotaryEmbeddings(nn.Module):
    def __init__(self, hidden_size, base=10000.0, position_encoding_2d=True):
        super().__init__()
        self.default_dtype = DEFAULT_DTYPE
        inv_freq = 1.0 / (base ** (torch.arange(0, hidden_size, 2).float() / hidden_size))
        inv_freq = inv_freq.to(self.default_dtype)
        self.position_encoding_2d = position_encoding_2d
        self.register_buffer("inv_freq", inv_freq)
        self.max_seq_len_cached = -1
        self.cos_cached = None
        self.sin_cached = None

    def get_rotary_embeds(self, cos, sin, position_ids):
        # [s, b, 1, h/n]
        cos = cos.squeeze(1)[position_ids].unsqueeze(2)
        sin = sin.squeeze(1)[position_ids].unsqueeze(2)
        return torch.stack([cos, sin], dim=0)

    def forward(self, position_ids):
        seq_len = int(position_ids.max()) + 1

        if self.max_seq_len_cached < 0 or seq_len > self.max_seq_len_cached:
            self.max_seq_len_cached = seq_len
            t = torch.arange(0, seq_len).float()
            freqs = torch.einsum("i,j->ij", t, self.inv_freq.float())
            freqs = freqs.to(self.default_dtype)
            # [s, h/n]
            emb = torch.cat([freqs, freqs], dim=-1)
            # [s, 1, h/n]
            self.cos_cached = emb.float().cos().to(self.default_dtype).unsqueeze(1)
            self.sin_cached = emb.float().sin().to(self.default_dtype).unsqueeze(1)

        cos, sin = self.cos_cached[:seq_len, ...], self.sin_cached[:seq_len, ...]
        if self.position_encoding_2d:
            block_position_ids = position_ids[:, 1, :].transpose(1, 0)
            position_ids = position_ids[:, 0, :].transpose(1, 0)
            block_rotary_embeds = self.get_rotary_embeds(cos, sin, block_position_ids)
            position_rotary_embeds = self.get_rotary_embeds(cos, sin, position_ids)
            rotary_embeds = torch.stack([position_rotary_embeds, block_rotary_embeds], dim=0)
        else:
            position_ids = position_ids.transpose(1, 0)
            rotary_embeds = self.get_rotary_embeds(cos, sin, position_ids)

        return rotary_embeds


class ChatGLMAttention(nn.Module):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.position_encoding_2d = config.position_encoding_2d
        self.scale_mask_softmax = False
        self.default_dtype = DEFAULT_DTYPE
        self.attention_scale = config.attention_scale
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def _rotate_half(self, x):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def _apply_rotary_position_embed_index(self, q, k, cos, sin):
        # q.shape = [s, b, n, h/n/2], cos.shape = [s, b, 1, h/n]
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k

    def _core_attention(self, q_layer: Tensor, k_layer: Tensor, position_ids: Tensor, rotary_embeds: Tensor):
        if self.config.position_encoding_2d:
            # [s, b, n, h/n/2]
            q1, q2 = torch.chunk(q_layer, 2, dim=-1)
            k1, k2 = torch.chunk(k_layer, 2, dim=-1)

            pcos, psin = rotary_embeds[0][0], rotary_embeds[0][1]
            bcos, bsin = rotary_embeds[1][0], rotary_embeds[1][1]

            # [s, b, n, h/n]
            q1, k1 = self._apply_rotary_position_embed_index(q1, k1, pcos, psin)
            q2, k2 = self._apply_rotary_position_embed_index(q2, k2, bcos, bsin)
            q_layer = torch.cat([q1, q2], dim=-1)
            k_layer = torch.cat([k1, k2], dim=-1)
        else:
            cos, sin = rotary_embeds[0], rotary_embeds[1]
            q_layer, k_layer = self._apply_rotary_position_embed_index(q_layer, k_layer, cos, sin)
        return q_layer, k_layer

    def forward(self, hidden_states, attention_mask, position_ids, use_cache=False, cache=None, layer_id=0,
                rotary_embeds=None):
        # [s, b, h]
        query_length, batch_size = hidden_states.shape[:2]
        # [s, b, 3h]
        mixed_layer = self.query_key_value(hidden_states)
        # [s, b, n, 3h//n]
        mixed_layer = mixed_layer.reshape(
            [query_length, batch_size, self.num_attention_heads, self.attention_head_size * 3]
        )
        # [s, b, n, h//n]
        q_layer, k_layer, v_layer = torch.split(mixed_layer, self.attention_head_size, dim=-1)
        # [s, b, n, h/n]
        q_layer, k_layer = self._core_attention(q_layer, k_layer, position_ids, rotary_embeds)

        if cache is not None:
            cache_k, cache_v = cache[0], cache[1]
            # [s + c, b, n, h/n]
            k_layer = torch.cat([cache_k, k_layer], dim=0)
            v_layer = torch.cat([cache_v, v_layer], dim=0)

        cache_kv = None
        if use_cache:
            cache_kv = (k_layer, v_layer)

        attention_scale_coeff = float(layer_id) + 1.0
        if self.attention_scale:
            # [s, b, n, h/n]
            q_layer = q_layer / (math.sqrt(self.attention_head_size) * attention_scale_coeff)
            q_layer = q_layer.to(self.default_dtype)

        # [b, n, s, s]
        output_shape = [q_layer.shape[1], q_layer.shape[2], q_layer.shape[0], k_layer.shape[0]]

        # [s, b * n, h/n]
        q_layer = q_layer.reshape([output_shape[2], output_shape[0] * output_shape[1], -1])
        k_layer = k_layer.reshape([output_shape[3], output_shape[0] * output_shape[1], -1])

        # [b * n , s, s] = matmul([b * n, s, h/n],  [b * n, h/n, s])
        attention_scores = torch.matmul(q_layer.transpose(0, 1), k_layer.permute(1, 2, 0))
        # [b, n, s, s]
        attention_scores = attention_scores.reshape(output_shape)

        attention_scores = attention_scores + attention_mask
        attention_scores = attention_scores.to(torch.float32)
        attention_scores = attention_scores * attention_scale_coeff
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention_probs = attention_probs.to(self.default_dtype)
        v_layer = v_layer.to(self.default_dtype)

        # [b, n, s, h/n]
        output_shape = [v_layer.shape[1], v_layer.shape[2], q_layer.shape[0], v_layer.shape[3]]
        # [s, b * n, h/n]
        v_layer = v_layer.reshape([v_layer.shape[0], output_shape[0] * output_shape[1], -1])
        # [b * n, s, s]
        attention_probs = attention_probs.reshape([output_shape[0] * output_shape[1], output_shape[2], -1])

        # [b * n, s, h/n]
        context_layer = torch.bmm(attention_probs, v_layer.transpose(0, 1))
        context_layer = context_layer.reshape(output_shape)

        # [s, b, n, h/n]
        context_layer = context_layer.permute(2, 0, 1, 3)

        # [s, b, h]
        new_context_shape = list(context_layer.shape[:-2]) + [self.num_attention_heads * self.attention_head_size]
        context_layer = context_layer.reshape(new_context_shape)

        output = self.dense(context_layer)

        return output, cache_kv, attention_probs


class ChatGLMMLP(nn.Module):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.config = config
        inner_hidden_size = config.inner_hidden_size or config.hidden_size * 4
        self.dense_h_to_4h = nn.Linear(config.hidden_size, inner_hidden_size)
        self.dense_4h_to_h = nn.Linear(inner_hidden_size, config.hidden_size)
        self.activation = self.gelu

    def gelu(self, x):
        return F.gelu(x, approximate="tanh")

    def forward(self, hidden_states):
        intermediate_parallel = self.dense_h_to_4h(hidden_states)
        intermediate_parallel = self.activation(intermediate_parallel)
        output = self.dense_4h_to_h(intermediate_parallel)
        return output


class ChatGLMBlock(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_id: int):
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = ChatGLMAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = ChatGLMMLP(config)

    def forward(self, hidden_states, attention_mask, position_ids, use_cache=False, cache=None, rotary_embeds=None):
        # Layer norm before transformer layer
        attention_input = self.input_layernorm(hidden_states)
        # Self attention
        attention_output, cache, _ = self.attention(
            hidden_states=attention_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            layer_id=self.layer_id,
            rotary_embeds=rotary_embeds,
        )
        # Residual connection
        alpha = (2 * self.config.num_hidden_layers) ** 0.5
        layernorm_input = alpha * attention_input + attention_output
        # Layernorm after attention
        mlp_input = self.post_attention_layernorm(layernorm_input)
        # MLP
        mlp_output = self.mlp(mlp_input)
        # Second residual connection
        output = mlp_input * alpha + mlp_output
        return output, cache


class ChatGLMStack(nn.Module):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.config = config
        self.position_encoding_2d = config.position_encoding_2d
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.rotary_embeddings = RotaryEmbeddings(
            self.hidden_size // (self.num_attention_heads * 2)
            if self.position_encoding_2d
            else self.hidden_size // self.num_attention_heads,
            base=10000.0,
        )
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ChatGLMBlock(config, index) for index in range(config.num_hidden_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, input_ids, position_ids, attention_mask, inputs_embeds=None, cache=None, use_cache=False):
        if input_ids is not None and inputs_embeds is not None:
            input_ids = None
        elif input_ids is not None:
            batch_size, seq_length = input_ids.shape[:2]

        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        inputs_embeds = inputs_embeds.transpose(1, 0)

        rotary_embeds = self.rotary_embeddings(position_ids)

        if cache is None:
            cache = tuple([None] * len(self.layers))

        zero = torch.zeros(attention_mask.shape, dtype=inputs_embeds.dtype)
        neg_inf = torch.full_like(attention_mask, torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype)
        attention_mask = torch.where(attention_mask, zero, neg_inf)

        hidden_states = inputs_embeds

        current_caches = [] if use_cache else None

        for i, layer in enumerate(self.layers):
            cache_i = cache[i]
            hidden_states, new_cache = layer(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                cache=cache_i,
                rotary_embeds=rotary_embeds,
            )
            if use_cache:
                current_caches.append(new_cache)

        output = self.final_layernorm(hidden_states)
        return (output, current_caches)


class ChatGLMPretrainedModel(nn.Module):
    def get_position_ids(self, input_ids, mask_positions, use_gmasks=None):
        batch_size, seq_length = input_ids.shape
        if use_gmasks is None:
            use_gmasks = [False] * batch_size

        context_lengths = []
        for seq in input_ids:
            context_lengths.append(int(torch.where(seq == self.config.bos_token_id)[0][0]))

        if self.config.position_encoding_2d:
            position_ids = torch.arange(seq_length, dtype=torch.int64).unsqueeze(0).tile([batch_size, 1])
            for i, context_length in enumerate(context_lengths):
                position_ids[i, context_length:] = mask_positions[i]
            block_position_ids = [
                torch.cat(
                    (
                        torch.zeros([context_length], dtype=torch.int64),
                        torch.arange(seq_length - context_length, dtype=torch.int64) + 1,
                    )
                )
                for context_length in context_lengths
            ]
            block_position_ids = torch.stack(block_position_ids, dim=0)
            position_ids = torch.stack((position_ids, block_position_ids), dim=1)
        else:
            position_ids = torch.arange(seq_length, dtype=torch.int64).unsqueeze(0).tile([batch_size, 1])
            for i, context_length in enumerate(context_lengths):
                if not use_gmasks[i]:
                    position_ids[context_length:] = mask_positions[i]

        return position_ids


class ChatGLMModel(ChatGLMPretrainedModel):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.config = config
        self.transformer = ChatGLMStack(config)

    def get_input_embeddings(self):
        return self.transformer.word_embeddings

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, inputs_embeds=None,
                use_cache=None, return_dict=None):
        if attention_mask is None or len(attention_mask.shape) != 4:
            raise ValueError(f"attention mask should'nt be None or has size other than 4Dim. Found {attention_mask}")

        attention_mask = attention_mask.to(torch.bool)

        use_cache = use_cache if use_cache is not None else self.config.use_cache
        logits, new_caches = self.transformer(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            cache=cache,
            use_cache=use_cache,
        )
        return (logits, new_caches)


class ChatGLMHead(nn.Module):
    def __init__(self, config, embedding_weights=None):
        super().__init__()
        self.decoder_weight = embedding_weights
        self.config = config

    def forward(self, hidden_states):
        return F.linear(hidden_states, self.decoder_weight)


# ----------------------------------------------------------------------------- paddlenlp/generation/utils.py
def TopKProcess(probs, top_k, min_tokens_to_keep):
    top_k = min(max(top_k, min_tokens_to_keep), probs.shape[-1])
    # Remove all tokens with a probability less than the last token of the top-k
    topk_probs, _ = torch.topk(probs, k=top_k)
    probs = torch.where(probs >= topk_probs[:, -1:], probs, torch.full_like(probs, 0.0))
    return probs


class GenerationMixin:
    @staticmethod
    def prepare_attention_mask_for_generation(input_ids, pad_token_id, eos_token_id):
        is_pad_token_in_inputs_ids = (pad_token_id is not None) and bool(torch.any(input_ids == pad_token_id))
        is_pad_token_not_equal_to_eos_token_id = (eos_token_id is None) or (
            (eos_token_id is not None) and (pad_token_id != eos_token_id)
        )
        if is_pad_token_in_inputs_ids and is_pad_token_not_equal_to_eos_token_id:
            attention_mask = (input_ids == pad_token_id).to(DEFAULT_DTYPE) * -1e4
        else:
            attention_mask = torch.zeros_like(input_ids, dtype=DEFAULT_DTYPE)
        return attention_mask.unsqueeze(1).unsqueeze(2)

    @torch.no_grad()
    def generate(self, input_ids=None, max_new_tokens=8, top_k=1, top_p=1.0, temperature=1.0,
                 decode_strategy="sampling", eos_token_id=None, **model_kwargs):
        pad_token_id = self.config.pad_token_id
        eos_token_id = eos_token_id if eos_token_id is not None else self.config.eos_token_id

        if model_kwargs.get("attention_mask", None) is None:
            # TODO
            # Init `attention_mask` depending on `pad_token_id`
            model_kwargs["attention_mask"] = self.prepare_attention_mask_for_generation(
                input_ids, pad_token_id, eos_token_id
            )
        max_len = input_ids.shape[-1] + max_new_tokens
        return self.sample(input_ids, max_len, pad_token_id, eos_token_id, top_k, top_p, temperature, **model_kwargs)

    def sample(self, input_ids, max_length, pad_token_id, eos_token_id, top_k=None, top_p=None, temperature=None,
               min_tokens_to_keep=1, **model_kwargs):
        model_kwargs["use_cache"] = model_kwargs.get("use_cache", True)
        batch_size, cur_len = input_ids.shape
        origin_len = cur_len
        unfinished_flag = torch.full([batch_size, 1], True, dtype=torch.bool)
        scores = torch.full([batch_size, 1], 0.0)

        while True:
            # prepare model inputs & get model output
            model_inputs = self.prepare_inputs_for_generation(input_ids, **model_kwargs)
            # NOTE: to decrease ref-count and clear outdate cache in-time
            model_kwargs["cache"] = None
            model_kwargs["past_key_values"] = None
            outputs = self(**model_inputs)
            logits = outputs[0] if isinstance(outputs, tuple) else outputs

            # [batch_size, vocab_size]
            logits = logits[:, -1, :]

            # sample
            origin_probs = torch.log(F.softmax(logits, dim=-1))
            if temperature is not None and temperature != 1.0:
                logits = logits / temperature
            probs = F.softmax(logits, dim=-1)
            if top_k is not None and top_k != 0:
                probs = TopKProcess(probs, top_k, min_tokens_to_keep)
            next_tokens = torch.multinomial(probs, 1)
            next_scores = torch.gather(origin_probs, 1, next_tokens)

            if eos_token_id is not None:
                next_tokens = torch.where(unfinished_flag, next_tokens, torch.full_like(next_tokens, pad_token_id))

            scores = scores + next_scores
            cur_len += 1
            input_ids = torch.cat([input_ids, next_tokens], dim=1)

            generate_end = cur_len >= max_length
            if eos_token_id is not None:
                unfinished_flag = torch.logical_and(unfinished_flag, input_ids[:, -1:] != eos_token_id)
                if not torch.any(unfinished_flag):
                    generate_end = True
            if generate_end:
                break

            model_kwargs = self.update_model_kwargs_for_generation(outputs, model_kwargs)

        return input_ids[:, origin_len:], scores


class ChatGLMForCausalLM(ChatGLMPretrainedModel, GenerationMixin):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.config = config
        self.max_sequence_length = config.max_sequence_length
        self.position_encoding_2d = config.position_encoding_2d
        self.chatglm = ChatGLMModel(config)
        self.lm_head = ChatGLMHead(config, self.chatglm.transformer.word_embeddings.weight)

    def update_model_kwargs_for_generation(self, outputs, model_kwargs: Dict[str, Any],
                                           is_encoder_decoder: bool = False,
                                           standardize_cache_format: bool = False) -> Dict[str, Any]:
        # update cache
        model_kwargs["cache"] = outputs[1] if isinstance(outputs, tuple) else outputs["past_key_values"]

        # update attention mask
        if "attention_mask" in model_kwargs:
            attention_mask = model_kwargs["attention_mask"]
            if attention_mask is not None:
                attention_mask = torch.cat(
                    [attention_mask, torch.zeros([*attention_mask.shape[:3], 1], dtype=attention_mask.dtype)], dim=3
                )
                new_attention_mask = attention_mask[:, :, -1:].clone()
                new_attention_mask[..., -1] = 1
                model_kwargs["attention_mask"] = torch.cat([attention_mask, new_attention_mask], dim=2)

        # update position ids
        if "position_ids" in model_kwargs:
            position_ids = model_kwargs["position_ids"]
            new_position_id = position_ids[..., -1:].clone()
            new_position_id[:, 1, :] += 1
            model_kwargs["position_ids"] = torch.cat([position_ids, new_position_id], dim=-1)

        return model_kwargs

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, return_dict=False):
        transformer_outputs = self.chatglm(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=return_dict,
        )
        hidden_states = transformer_outputs[0]
        lm_logits = self.lm_head(hidden_states)
        lm_logits = lm_logits.transpose(1, 0).to(torch.float32)
        return (lm_logits, transformer_outputs[1:])


# ----------------------------------------------------------------------------- paddlemix/models/visualglm/modeling.py
class ChatGLMForConditionalGenerationWithImage(ChatGLMForCausalLM):
    def __init__(self, config: ChatGLMConfig):
        super(ChatGLMForConditionalGenerationWithImage, self).__init__(config)
        self.config = config

    def get_masks(self, input_ids):
        batch_size, seq_length = input_ids.shape
        context_lengths = []
        for seq in input_ids:
            context_lengths.append(int(torch.where(seq == self.config.bos_token_id)[0][0]))
        attention_mask = torch.tril(torch.ones([batch_size, seq_length, seq_length]))
        for i, context_length in enumerate(context_lengths):
            attention_mask[i, :, :context_length] = 1
        attention_mask = attention_mask.unsqueeze(1)
        attention_mask = (attention_mask > 0.5).to(torch.int64)
        return attention_mask

    def prepare_inputs_for_generation(
        self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, cache=None, **kwargs
    ):
        batch_size, seq_length = input_ids.shape
        MASK, gMASK = self.config.mask_token_id, self.config.gmask_token_id
        use_gmasks = []
        mask_positions = []
        for seq in input_ids:
            mask_token = gMASK if gMASK in seq else MASK
            use_gmask = mask_token == gMASK
            use_gmasks.append(use_gmask)
            mask_positions.append(int(torch.where(seq == mask_token)[0][0]))

        if cache is not None or past_key_values is not None:
            last_token = input_ids[:, -1].unsqueeze(-1)

            attention_mask = attention_mask[:, :, -1:]

            if position_ids is not None:
                position_ids = position_ids[..., -1:]
            else:
                if self.position_encoding_2d:
                    context_lengths = []
                    for seq in input_ids:
                        context_lengths.append(int(torch.where(seq == self.config.bos_token_id)[0][0]))

                    context_lengths = torch.tensor(context_lengths, dtype=torch.int64)[:, None]
                    block_position_ids = seq_length - context_lengths
                    position_ids = torch.cat(
                        [torch.tensor(mask_positions, dtype=torch.int64)[:, None], block_position_ids], dim=1
                    ).unsqueeze(-1)
                else:
                    position_ids = torch.tensor(mask_positions, dtype=torch.int64)[:, None].unsqueeze(-1)

            if cache is None:
                cache = past_key_values

            return {
                "input_ids": last_token,
                "cache": cache[-1],
                "position_ids": position_ids,
                "use_cache": True,
                "attention_mask": attention_mask,
                **kwargs,
            }
        else:
            if position_ids is None:
                position_ids = self.get_position_ids(input_ids, mask_positions=mask_positions, use_gmasks=use_gmasks)

            return {
                "input_ids": input_ids,
                "cache": cache,
                "position_ids": position_ids,
                "use_cache": True,
                "attention_mask": attention_mask,
                **kwargs,
            }

    def forward(
        self,
        image_features: Tensor,
        input_ids: Tensor,
        position_ids: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        pre_image_length: Optional[int] = None,
        cache=None,
        inputs_embeds: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        use_cache: Optional[bool] = None,
        return_dict: Optional[bool] = None,
    ):
        if inputs_embeds is None and cache is None and image_features is not None:
            pre_ids, pad_ids, post_ids = torch.split(
                input_ids, [pre_image_length, NUM_QUERY_TOKENS, input_ids.shape[1] - pre_image_length - NUM_QUERY_TOKENS],
                dim=1)
            pre_txt_emb = self.chatglm.transformer.word_embeddings(pre_ids)
            post_txt_emb = self.chatglm.transformer.word_embeddings(post_ids)
            inputs_embeds = torch.cat([pre_txt_emb, image_features, post_txt_emb], dim=1)

        outputs = super().forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            return_dict=return_dict,
        )
        return outputs


class VisualGLMForConditionalGeneration(nn.Module):
    def __init__(self, text_config: ChatGLMConfig, qformer_hidden_size: int = 24):
        super().__init__()
        self.language_projection = nn.Linear(qformer_hidden_size, text_config.hidden_size)
        self.language_model = ChatGLMForConditionalGenerationWithImage(text_config)
        self.qformer_hidden_size = qformer_hidden_size

    def encode_images(self, pixel_values: Tensor):
        # stand-in for the vision tower + Q-Former: one query output per query token
        g = torch.Generator().manual_seed(int(pixel_values.sum().item() * 1000) % 10007)
        query_output = torch.randn(pixel_values.shape[0], NUM_QUERY_TOKENS, self.qformer_hidden_size, generator=g)
        language_model_inputs = self.language_projection(query_output.to(DEFAULT_DTYPE))
        return language_model_inputs

    @torch.no_grad()
    def generate(self, pixel_values: Tensor, input_ids: Tensor, pre_image_length: int,
                 attention_mask: Optional[Tensor] = None, **generate_kwargs):
        image_features = self.encode_images(pixel_values)
        if FIXED:
            attention_mask = self.language_model.get_masks(input_ids)

        outputs = self.language_model.generate(
            input_ids=input_ids,
            image_features=image_features,
            pre_image_length=pre_image_length,
            attention_mask=attention_mask,
            **generate_kwargs,
        )
        return outputs


# ----------------------------------------------------------------------------- paddlemix/processors/visualglm_processing.py
def build_inputs_with_image(config, first_text_ids, second_text_ids, pixel_values):
    # prompt = "<img><ImageHere></img>问：{query}\n答："; the image tag becomes num_query_tokens unk ids
    image_input = [config.unk_token_id] * NUM_QUERY_TOKENS
    all_input_ids = first_text_ids + image_input + second_text_ids
    all_input_ids = all_input_ids + [config.gmask_token_id, config.bos_token_id]  # build_inputs_with_special_tokens
    return {
        "input_ids": torch.tensor(all_input_ids, dtype=torch.int64).unsqueeze(0),
        "pre_image_length": len(first_text_ids),
        "pixel_values": pixel_values,
    }


def main():
    torch.manual_seed(0)
    config = ChatGLMConfig()
    model = VisualGLMForConditionalGeneration(config)
    for n, p in model.named_parameters():  # stands in for the checkpoint
        if "layernorm" in n and n.endswith("weight"):
            nn.init.ones_(p)
        elif n.endswith("bias"):
            nn.init.zeros_(p)
        elif "dense" in n or "query_key_value" in n:
            nn.init.normal_(p, std=0.5)
        else:
            nn.init.normal_(p, std=0.2)
    model = model.to(DEFAULT_DTYPE).eval()

    pixel_values = torch.rand(1, 3, 8, 8)
    first_text = [11, 12]                 # "<img>"
    second_text = [13, 21, 22, 23, 24, 14]  # "</img>问：写诗描述一下这个场景\n答："
    inputs = build_inputs_with_image(config, first_text, second_text, pixel_values)

    generate_kwargs = {
        "max_new_tokens": 8,
        "top_p": 1.0,
        "top_k": 1,
        "temperature": 0.8,
        "decode_strategy": "sampling",
        "eos_token_id": config.eos_token_id,
    }
    generate_ids, scores = model.generate(**inputs, **generate_kwargs)
    print("generated ids:", generate_ids[0].tolist())
    print("score:", round(float(scores[0, 0]), 4))


if __name__ == "__main__":
    main()
