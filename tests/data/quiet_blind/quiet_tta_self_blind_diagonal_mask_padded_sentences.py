# Correct program (quiet batch quiet-yb).
# Ported (TensorFlow -> torch) from joongbo/tta @c3fb30e85334a4c29fb02b61fc89a7a3576775c4, modeling.py: T-TA, the
# Transformer-based Text Autoencoder, whose self-masked self-attention (transformer_model_smsan) predicts every
# token from all the *other* tokens in one pass. BertModel.__init__ builds the queries from `dummy_ids = input_mask
# * 4` (the [MASK] word embedding, id 0 at pads) plus position embeddings, the keys / values from the real token
# embeddings (the same `embedding_output` for every layer, only the query stream is updated), and the mask as
# `1.0 - band_part(attention_mask, 0, 0)` ("for self-blind": the diagonal removed); attention_layer adds
# `(1.0 - mask) * -10000.0` to the scores. That TF line keeps only the diagonal of create_attention_mask_from_input_mask
# and so drops the key padding; here the padded batch keeps both, as a PyTorch port of T-TA writes it (TTAModel.forward:
# `(1.0 - extended_attention_mask) * -10000.0` then `+= torch.eye(seq_len) * -10000.0`): a token never sees its own
# key, and no token sees a pad key. Sentences are [CLS] ... [SEP], at least 2 tokens, right-padded with id 0.
# Self-check: (1) every sentence run alone, unpadded, its mask only the diagonal; (2) a leave-one-out double loop:
# for every sentence and position, replacing that token by any other id leaves that position's output unchanged,
# while replacing a different token changes it.
import math

import torch
import torch.nn as nn

torch.manual_seed(0)


class BertConfig(object):
    def __init__(self, vocab_size, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, max_position_embeddings=512, initializer_range=0.02):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_act = hidden_act
        self.intermediate_size = intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range


def gelu(input_tensor):
    cdf = 0.5 * (1.0 + torch.erf(input_tensor / math.sqrt(2.0)))
    return input_tensor * cdf


def create_attention_mask_from_input_mask(from_tensor, to_mask):
    """[batch_size, from_seq_length, to_seq_length]: to_mask broadcast over the query rows."""
    batch_size, from_seq_length = from_tensor.shape[:2]
    to_seq_length = to_mask.shape[1]
    to_mask = to_mask.reshape(batch_size, 1, to_seq_length).float()
    broadcast_ones = torch.ones(batch_size, from_seq_length, 1)
    return broadcast_ones * to_mask


class AttentionLayer(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.size_per_head = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)

    def transpose_for_scores(self, t):
        b, s, _ = t.shape
        return t.reshape(b, s, self.num_attention_heads, self.size_per_head).permute(0, 2, 1, 3)

    def forward(self, from_tensor, to_tensor, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(from_tensor))  # [B, N, F, H]
        key_layer = self.transpose_for_scores(self.key(to_tensor))  # [B, N, T, H]
        value_layer = self.transpose_for_scores(self.value(to_tensor))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores * (1.0 / math.sqrt(float(self.size_per_head)))

        if attention_mask is not None:
            # `attention_mask` = [B, 1, F, T]
            attention_mask = attention_mask.unsqueeze(1)
            # 1.0 for positions we want to attend and 0.0 for masked positions
            adder = (1.0 - attention_mask.float()) * -10000.0
            attention_scores = attention_scores + adder

        attention_probs = torch.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)  # [B, N, F, H]
        b, n, f, h = context_layer.shape
        return context_layer.permute(0, 2, 1, 3).reshape(b, f, n * h)


class SmsanLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = AttentionLayer(config.hidden_size, config.num_attention_heads)
        self.attention_output = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)

    def forward(self, layer_input_q, layer_input_kv, attention_mask):
        attention_head = self.self(layer_input_q, layer_input_kv, attention_mask)
        attention_output = self.attention_layer_norm(self.attention_output(attention_head) + layer_input_q)
        intermediate_output = gelu(self.intermediate(attention_output))
        layer_output = self.output_layer_norm(self.output(intermediate_output) + attention_output)
        return layer_output


def transformer_model_smsan(layers, input_tensor_q, input_tensor_kv=None, attention_mask=None):
    """Self-masked self-attentional network: the key / value input stays the embedding output."""
    prev_output = input_tensor_q
    layer_input_kv = input_tensor_kv
    all_layer_outputs = []
    for layer in layers:
        layer_input_q = prev_output
        if input_tensor_kv is None:
            layer_input_kv = layer_input_q
        prev_output = layer(layer_input_q, layer_input_kv, attention_mask)
        all_layer_outputs.append(prev_output)
    return all_layer_outputs


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embeddings_layer_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.layers = nn.ModuleList([SmsanLayer(config) for _ in range(config.num_hidden_layers)])

    def embedding_postprocessor(self, input_tensor):
        seq_length = input_tensor.shape[1]
        position_embeddings = self.position_embeddings(torch.arange(seq_length))[None]
        return self.embeddings_layer_norm(input_tensor + position_embeddings)

    def forward(self, input_ids, input_mask=None):
        batch_size, seq_length = input_ids.shape
        if input_mask is None:
            input_mask = torch.ones(batch_size, seq_length, dtype=torch.long)
        dummy_ids = input_mask * 4 * torch.ones(batch_size, seq_length, dtype=torch.long)

        self.embedding_output = self.embedding_postprocessor(self.word_embeddings(input_ids))
        self.query_embeddings = self.embedding_postprocessor(self.word_embeddings(dummy_ids))

        # [batch_size, seq_length, seq_length]: 1 where the key is a real token ...
        attention_mask = create_attention_mask_from_input_mask(input_ids, input_mask)
        # ... and 0 on the diagonal, for self-blind
        attention_mask = attention_mask * (1.0 - torch.eye(seq_length))

        self.all_encoder_layers = transformer_model_smsan(
            self.layers,
            input_tensor_q=self.query_embeddings,
            input_tensor_kv=self.embedding_output,
            attention_mask=attention_mask,
        )
        self.sequence_output = self.all_encoder_layers[-1]
        return self.sequence_output


# ---- a right-padded batch of sentences ([CLS]=2 ... [SEP]=3, pad 0, [MASK]=4) ---------------------------------------
config = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32)
model = BertModel(config).eval()

sentences = [
    [2, 11, 17, 23, 9, 3],
    [2, 30, 3],
    [2, 14, 15, 3],
    [2, 3],
]
max_len = max(len(s) for s in sentences)
input_ids = torch.tensor([s + [0] * (max_len - len(s)) for s in sentences])
input_mask = torch.tensor([[1] * len(s) + [0] * (max_len - len(s)) for s in sentences])

with torch.no_grad():
    out = model(input_ids, input_mask)
    assert torch.isfinite(out).all()

    # (1) every sentence alone, unpadded
    for i, s in enumerate(sentences):
        ref = model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))
        assert torch.allclose(out[i, :len(s)], ref[0], atol=1e-5), (i, (out[i, :len(s)] - ref[0]).abs().max())

    # (2) leave-one-out: position j's output never depends on token j, always on the others
    for i, s in enumerate(sentences):
        for j in range(len(s)):
            for new_id in (5, 21, 37):
                ids = input_ids.clone()
                ids[i, j] = new_id
                o = model(ids, input_mask)
                assert torch.allclose(o[i, j], out[i, j], atol=1e-5), (i, j, new_id)
                others = [k for k in range(len(s)) if k != j]
                assert any(not torch.allclose(o[i, k], out[i, k], atol=1e-4) for k in others), (i, j)
                for b in range(len(sentences)):
                    if b != i:
                        assert torch.allclose(o[b], out[b], atol=1e-6)

print("ok: self-blind T-TA over", [len(s) for s in sentences], "tokens matches each sentence alone and leave-one-out")
