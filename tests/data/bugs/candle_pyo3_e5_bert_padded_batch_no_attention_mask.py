# Citation: huggingface/candle#1085 (commit 75989fc3b, "Use an attention mask in the e5 padding case."),
#   candle-pyo3/e5.py and candle-pyo3/py_src/candle/models/bert.py read at 75989fc3b^ and 75989fc3b.
#   candle's Python bindings carry a BERT written after transformers' modeling_bert.py; e5.py runs
#   intfloat/e5-small-v2 through it and through the HF model, mean-pools both and prints the L1 error.
#   The candle ops are written here with torch (broadcast_add -> +, where_cond -> torch.where).
# Where: BertModel.forward / BertSelfAttention.forward (the candle port) and e5.py's forward call.
# Bug: the port's BertSelfAttention took no mask at all and e5.py called model.forward(tokens, token_type_ids)
#   on a batch the tokenizer padded to the longest sentence, so every real token of a short sentence attended
#   to the [PAD] keys; only the pooling looked at the attention_mask. (Here the mask-taking classes are kept and
#   the run before the fix calls model(tokens, token_type_ids) as e5.py did, which reaches the same scores.)
# Fix: BertModel.forward takes attention_mask, turns it into an additive bias (where_cond: 1 -> 1.0, 0 -> -inf),
#   every BertSelfAttention adds it, reshaped (b, 1, 1, L), to the scores; e5.py passes the tokenizer's mask.
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import BertConfig, BertModel as HFBertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Config:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"
    use_cache: bool = True
    classifier_dropout: Optional[float] = None
    model_type: Optional[str] = "bert"


class BertSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / self.num_attention_heads)
        all_head_size = int(config.num_attention_heads * self.attention_head_size)
        hidden_size = config.hidden_size
        self.query = nn.Linear(hidden_size, all_head_size)
        self.key = nn.Linear(hidden_size, all_head_size)
        self.value = nn.Linear(hidden_size, all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.shape[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.reshape(new_x_shape).transpose(1, 2)
        return x.contiguous()

    def forward(self, hidden_states, attention_mask=None):
        query = self.query(hidden_states)
        key = self.key(hidden_states)
        value = self.value(hidden_states)

        query = self.transpose_for_scores(query)
        key = self.transpose_for_scores(key)
        value = self.transpose_for_scores(value)

        attention_scores = query.matmul(key.transpose(-1, -2))
        attention_scores = attention_scores / float(self.attention_head_size) ** 0.5
        if attention_mask is not None:
            b_size, _, _, last_dim = attention_scores.shape
            attention_scores = attention_scores + attention_mask.reshape((b_size, 1, 1, last_dim))
        attention_probs = F.softmax(attention_scores, dim=-1)

        context_layer = attention_probs.matmul(value)
        context_layer = context_layer.transpose(1, 2).contiguous()
        context_layer = context_layer.flatten(-2)
        return context_layer


class BertSelfOutput(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        return self.LayerNorm(hidden_states + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        self_outputs = self.self(hidden_states, attention_mask=attention_mask)
        attention_output = self.output(self_outputs, hidden_states)
        return attention_output


class BertIntermediate(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = F.gelu if config.hidden_act == "gelu" else F.relu

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        return self.act(hidden_states)


class BertOutput(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        return self.LayerNorm(hidden_states + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask=attention_mask)
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        return layer_output


class BertEncoder(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList()
        for _ in range(config.num_hidden_layers):
            self.layer.append(BertLayer(config))

    def forward(self, hidden_states, attention_mask=None):
        for l in self.layer:
            hidden_states = l(hidden_states, attention_mask=attention_mask)
        return hidden_states


class BertEmbeddings(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, token_type_ids):
        (_batch_size, seq_len) = input_ids.shape
        input_embeddings = self.word_embeddings(input_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = input_embeddings + token_type_embeddings

        position_ids = torch.arange(seq_len, dtype=input_ids.dtype, device=input_ids.device)

        embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return embeddings


class BertPooler(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = torch.tanh

    def forward(self, hidden_states):
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense(first_token_tensor)
        pooled_output = self.activation(pooled_output)
        return pooled_output


def masked_fill(on_false: float, mask, on_true: float):
    shape = mask.shape
    on_true = torch.tensor(on_true).broadcast_to(shape)
    on_false = torch.tensor(on_false).broadcast_to(shape)
    return torch.where(mask.bool(), on_true, on_false)


class BertModel(nn.Module):
    def __init__(self, config: Config, add_pooling_layer=True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None

    def forward(self, input_ids, token_type_ids, attention_mask=None) -> Tuple:
        if attention_mask is not None:
            # Replace 0s with -inf, and 1s with 0s.
            attention_mask = masked_fill(float("-inf"), attention_mask, 1.0)
        embeddings = self.embeddings(input_ids, token_type_ids)
        encoder_out = self.encoder(embeddings, attention_mask=attention_mask)
        pooled_output = self.pooler(encoder_out) if self.pooler is not None else None
        return encoder_out, pooled_output


def tokenize(sentences, vocab, pad_id=0, cls_id=1, sep_id=2):
    """Stands in for BertTokenizer(sentences, padding=True): [CLS] words [SEP], right-padded with [PAD]."""
    ids = [[cls_id] + [vocab.setdefault(w, len(vocab) + 3) for w in s.lower().split()] + [sep_id] for s in sentences]
    longest = max(len(x) for x in ids)
    input_ids = [x + [pad_id] * (longest - len(x)) for x in ids]
    attention_mask = [[1] * len(x) + [0] * (longest - len(x)) for x in ids]
    token_type_ids = [[0] * longest for _ in ids]
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}


def main():
    # e5-small-v2 is a 12-layer, 384-wide BERT; tiny sizes here, built from the config class.
    raw_config = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=32, hidden_act="gelu",
                      initializer_range=0.2)
    hf_model = HFBertModel(BertConfig(**raw_config, attn_implementation="eager")).eval()

    config = Config()
    for name, value in raw_config.items():
        setattr(config, name, value)
    model = BertModel(config).eval()
    model.load_state_dict(hf_model.state_dict(), strict=False)

    sentences = [
        "The cat sits outside",
        "A man is playing guitar",
        "I love pasta",
        "The new movie is awesome",
        "The cat plays in the garden",
        "A woman watches TV",
        "The new movie is so great",
        "Do you like pizza?",
    ]

    def average_pool(last_hidden_states, attention_mask):
        """Average the hidden states according to the attention mask"""
        last_hidden = last_hidden_states.masked_fill(~attention_mask[..., None].bool(), 0.0)
        return last_hidden.sum(dim=1) / attention_mask.sum(dim=1)[..., None]

    vocab = {}
    tokenized = tokenize(sentences, vocab)
    tokens = torch.tensor(tokenized["input_ids"])
    token_type_ids = torch.tensor(tokenized["token_type_ids"])
    with torch.no_grad():
        if FIXED:
            attention_mask = torch.tensor(tokenized["attention_mask"])
            encoder_out, _ = model(tokens, token_type_ids, attention_mask=attention_mask)
        else:
            encoder_out, _ = model(tokens, token_type_ids)

        hf_tokenized = {k: torch.tensor(v) for k, v in tokenize(sentences, vocab).items()}
        hf_result = hf_model(**hf_tokenized)["last_hidden_state"]

    hf_pooled = average_pool(hf_result, hf_tokenized["attention_mask"])
    candle_pooled = average_pool(encoder_out, hf_tokenized["attention_mask"])

    loss = torch.nn.L1Loss()
    error = loss(hf_pooled, candle_pooled).mean().item()
    print(f"Mean error between torch-reference and candle: {error}")
    sims = F.normalize(candle_pooled, dim=-1) @ F.normalize(candle_pooled, dim=-1).T
    print("cos(cat sits outside, cat plays in the garden):", round(sims[0, 4].item(), 6))
    print("cos(I love pasta, Do you like pizza?):", round(sims[2, 7].item(), 6))


if __name__ == "__main__":
    main()
