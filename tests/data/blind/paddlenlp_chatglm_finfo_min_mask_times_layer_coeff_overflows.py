# PaddlePaddle/PaddleNLP#7501 ("[chatglm] Fix attention_score -nan bug"), paddlenlp/transformers/chatglm/modeling.py,
# the ChatGLM-6B port to Paddle (written here in torch, names and layout as PaddleNLP has them).
# ChatGLMStack turns the bool 4-D mask (True = keep) into an additive one with paddle.finfo(dtype).min, and
# ChatGLMAttention adds it to the scores *before* multiplying by the layer's coefficient (layer_id + 1), as the
# torch original did with its -10000 fill. finfo.min * 2 is -inf in float32: from the second layer on, a left pad's
# fully masked row becomes all -inf, softmax gives NaN, and the NaN rows of V reach every real token next layer.
# Fix (the PR's repro is `(scores + finfo.min) * 2 == -inf`; its diff was not read, the reorder here is the minimal
# one): the scores are scaled by the layer coefficient first and the finfo.min mask added after, so it stays finite.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ChatGLMConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 3
    num_layers = 3
    inner_hidden_size = 64
    layernorm_epsilon = 1e-5
    max_sequence_length = 64
    position_encoding_2d = True
    attention_scale = True
    activation = "gelu"
    pre_seq_len = None
    bos_token_id = 5
    eos_token_id = 4
    mask_token_id = 6
    gmask_token_id = 7
    pad_token_id = 3
    use_cache = False


class RotaryEmbeddings(nn.Module):
    def __init__(self, hidden_size, base=10000.0):
        super().__init__()
        self.dtype = torch.get_default_dtype()
        inv_freq = 1.0 / (base ** (torch.arange(0, hidden_size, 2).float() / hidden_size))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, x, seq_dim=1, seq_len=None):
        if seq_len is None:
            seq_len = x.shape[seq_dim]
        t = torch.arange(seq_len).to(self.dtype)
        freqs = torch.einsum("i,j->ij", t.float(), self.inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        # [s, 1, h/n]
        cos_cached = emb.cos().unsqueeze(1)
        sin_cached = emb.sin().unsqueeze(1)
        return cos_cached[:seq_len, ...], sin_cached[:seq_len, ...]


class ChatGLMAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.position_encoding_2d = config.position_encoding_2d
        self.rotary_embeddings = RotaryEmbeddings(
            self.hidden_size // (self.num_attention_heads * 2)
            if self.position_encoding_2d
            else self.hidden_size // self.num_attention_heads,
            base=10000.0,
        )
        self.scale_mask_softmax = False
        self.default_dtype = torch.get_default_dtype()
        self.attention_scale = config.attention_scale
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def _rotate_half(self, x):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def _apply_rotary_position_embed_index(self, q, k, cos, sin, position_ids):
        # q.shape = [s, b, n, h/n/2], cos.shape = [s, 1, h/n], position_ids.shape = [s, b]
        cos = cos.squeeze(1)[position_ids].unsqueeze(2)
        sin = sin.squeeze(1)[position_ids].unsqueeze(2)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k

    def _core_attention(self, q_layer, k_layer, position_ids):
        q1, q2 = torch.chunk(q_layer, 2, dim=-1)
        k1, k2 = torch.chunk(k_layer, 2, dim=-1)
        cos, sin = self.rotary_embeddings(q1, seq_len=int(position_ids.max()) + 1)
        # [s, b]
        block_position_ids = position_ids[:, 1, :].transpose(1, 0)
        position_ids = position_ids[:, 0, :].transpose(1, 0)
        q1, k1 = self._apply_rotary_position_embed_index(q1, k1, cos, sin, position_ids)
        q2, k2 = self._apply_rotary_position_embed_index(q2, k2, cos, sin, block_position_ids)
        q_layer = torch.cat([q1, q2], dim=-1)
        k_layer = torch.cat([k1, k2], dim=-1)
        return q_layer, k_layer

    def forward(self, hidden_states, attention_mask, position_ids, use_cache=False, cache=None, layer_id=0):
        # [s, b, h]
        query_length, batch_size = hidden_states.shape[:2]
        mixed_layer = self.query_key_value(hidden_states)
        mixed_layer = mixed_layer.reshape(
            [query_length, batch_size, self.num_attention_heads, self.attention_head_size * 3]
        )
        q_layer, k_layer, v_layer = torch.split(mixed_layer, self.attention_head_size, dim=-1)
        q_layer, k_layer = self._core_attention(q_layer, k_layer, position_ids)

        if cache is not None:
            cache_k, cache_v = cache[0], cache[1]
            k_layer = torch.cat([cache_k, k_layer], dim=0)
            v_layer = torch.cat([cache_v, v_layer], dim=0)

        cache_kv = (k_layer, v_layer) if use_cache else None

        attention_scale_coeff = float(layer_id) + 1.0
        if self.attention_scale:
            q_layer = q_layer / (math.sqrt(self.attention_head_size) * attention_scale_coeff)
            q_layer = q_layer.to(self.default_dtype)

        # [b, n, s, s]
        output_shape = [q_layer.shape[1], q_layer.shape[2], q_layer.shape[0], k_layer.shape[0]]
        q_layer = q_layer.reshape([output_shape[2], output_shape[0] * output_shape[1], -1])
        k_layer = k_layer.reshape([output_shape[3], output_shape[0] * output_shape[1], -1])
        attention_scores = torch.matmul(q_layer.permute(1, 0, 2), k_layer.permute(1, 2, 0))
        attention_scores = attention_scores.reshape(output_shape)

        if FIXED:
            attention_scores = attention_scores.float()
            attention_scores = attention_scores * attention_scale_coeff
            attention_scores = attention_scores + attention_mask
        else:
            attention_scores = attention_scores + attention_mask
            attention_scores = attention_scores.float()
            attention_scores = attention_scores * attention_scale_coeff
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention_probs = attention_probs.to(self.default_dtype)
        v_layer = v_layer.to(self.default_dtype)

        # [b, n, s, h/n]
        output_shape = [v_layer.shape[1], v_layer.shape[2], q_layer.shape[0], v_layer.shape[3]]
        v_layer = v_layer.reshape([v_layer.shape[0], output_shape[0] * output_shape[1], -1])
        attention_probs = attention_probs.reshape([output_shape[0] * output_shape[1], output_shape[2], -1])
        context_layer = torch.bmm(attention_probs, v_layer.permute(1, 0, 2))
        context_layer = context_layer.reshape(output_shape)
        # [s, b, n, h/n]
        context_layer = context_layer.permute(2, 0, 1, 3)
        new_context_shape = list(context_layer.shape[:-2]) + [self.num_attention_heads * self.attention_head_size]
        context_layer = context_layer.reshape(new_context_shape)
        output = self.dense(context_layer)
        return output, cache_kv, attention_probs


class ChatGLMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.inner_hidden_size)
        self.dense_4h_to_h = nn.Linear(config.inner_hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states), approximate="tanh"))


class ChatGLMBlock(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = ChatGLMAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = ChatGLMMLP(config)

    def forward(self, hidden_states, attention_mask, position_ids, use_cache=False, cache=None):
        attention_input = self.input_layernorm(hidden_states)
        attention_output, cache, _ = self.attention(
            hidden_states=attention_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            layer_id=self.layer_id,
        )
        alpha = (2 * self.config.num_hidden_layers) ** 0.5
        layernorm_input = alpha * attention_input + attention_output
        mlp_input = self.post_attention_layernorm(layernorm_input)
        mlp_output = self.mlp(mlp_input)
        output = mlp_input * alpha + mlp_output
        return output, cache


class ChatGLMStack(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ChatGLMBlock(config, index) for index in range(config.num_hidden_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, input_ids, position_ids, attention_mask, inputs_embeds=None, cache=None, use_cache=False):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        inputs_embeds = inputs_embeds.permute(1, 0, 2)

        if cache is None:
            cache = tuple([None] * len(self.layers))

        zero = torch.zeros(attention_mask.shape, dtype=inputs_embeds.dtype)
        neg_inf = torch.full(attention_mask.shape, torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype)
        attention_mask = torch.where(attention_mask, zero, neg_inf)

        hidden_states = inputs_embeds
        current_caches = [] if use_cache else None
        for i, layer in enumerate(self.layers):
            hidden_states, new_cache = layer(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                cache=cache[i],
            )
            if use_cache:
                current_caches.append(new_cache)
        output = self.final_layernorm(hidden_states)
        return output, current_caches


class ChatGLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = ChatGLMStack(config)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=None):
        if attention_mask is None or len(attention_mask.shape) != 4:
            raise ValueError("attention mask should'nt be None or has size other than 4Dim.")
        attention_mask = attention_mask.to(torch.bool)
        return self.transformer(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
            use_cache=bool(use_cache),
        )


class ChatGLMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.chatglm = ChatGLMModel(config)
        self.lm_head = self.chatglm.transformer.word_embeddings

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None):
        hidden_states, _ = self.chatglm(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask)
        lm_logits = F.linear(hidden_states, self.lm_head.weight).permute(1, 0, 2)
        loss = None
        if labels is not None:
            shift_logits = lm_logits[..., :-1, :].reshape([-1, lm_logits.shape[-1]]).float()
            shift_labels = labels[..., 1:].reshape([-1])
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        return loss, lm_logits


def tokenizer_encode(prompt_ids, config):
    """ChatGLMTokenizer.build_inputs_with_special_tokens + the 4-D mask / 2-D positions the tokenizer returns."""
    ids = list(prompt_ids) + [config.gmask_token_id, config.bos_token_id]
    seq_length = len(ids)
    context_length = ids.index(config.bos_token_id)
    mask_position = ids.index(config.gmask_token_id)
    attention_mask = torch.tril(torch.ones(seq_length, seq_length))
    attention_mask[:, :context_length] = 1
    position_ids = torch.arange(seq_length)
    position_ids[context_length:] = mask_position
    block_position_ids = torch.cat(
        [torch.zeros(context_length, dtype=torch.long), torch.arange(1, seq_length - context_length + 1)]
    )
    return ids, attention_mask, torch.stack([position_ids, block_position_ids])


def tokenizer_pad(encoded, config):
    """ChatGLMTokenizer._pad with padding_side="left": pad ids, zero mask rows and columns, zero positions."""
    max_len = max(len(e[0]) for e in encoded)
    batch_ids, batch_mask, batch_pos = [], [], []
    for ids, mask, pos in encoded:
        difference = max_len - len(ids)
        batch_ids.append([config.pad_token_id] * difference + ids)
        batch_mask.append(F.pad(mask, (difference, 0, difference, 0), value=0))
        batch_pos.append(F.pad(pos, (difference, 0), value=0))
    return (
        torch.tensor(batch_ids),
        torch.stack(batch_mask).unsqueeze(1).long(),
        torch.stack(batch_pos),
    )


def main():
    config = ChatGLMConfig()
    model = ChatGLMForCausalLM(config).eval()
    prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]]
    encoded = [tokenizer_encode(p, config) for p in prompts]
    input_ids, attention_mask, position_ids = tokenizer_pad(encoded, config)
    labels = input_ids.clone()
    labels[input_ids == config.pad_token_id] = -100
    with torch.no_grad():
        loss, logits = model(input_ids, position_ids=position_ids, attention_mask=attention_mask, labels=labels)
    next_tokens = logits[:, -1].argmax(-1)
    print("loss", float(loss))
    print("next tokens", next_tokens.tolist())
    print("last-token logits[:, :4]", logits[:, -1, :4].tolist())


if __name__ == "__main__":
    main()
