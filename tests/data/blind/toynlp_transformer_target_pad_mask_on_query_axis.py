# Citation: ai-glimpse/toynlp#52 ("fix(attention): fix wrong broadcast", fixes #50),
#   merge commit 352f7b4; buggy parent 352f7b4^.
# Upstream: toynlp/transformer/model.py TransformerModel._get_target_mask,
#   ScaleDotProductionAttention.forward (masked_fill with -10000), trained by
#   toynlp/transformer/train.py calc_loss_batch on right-padded Multi30k batches.
# Bug: _get_target_mask built the target padding mask as
#   (ids != pad).unsqueeze(1).unsqueeze(3), shape (b, 1, T, 1): it is broadcast
#   along the key axis, so it masks whole *query rows* of padded positions (which
#   then, filled with -10000, spread uniformly over every key, future included)
#   and never masks padded *keys*.
# Fix: .unsqueeze(1).unsqueeze(2), shape (b, 1, 1, T) (key padding AND causal),
#   and the fill value -10000 -> -inf.
# Port notes: tiny TransformerConfig, CPU, dropout 0, hand-made token ids in place
#   of the tokenizer / dataset.
import sys
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
current_device = torch.device("cpu")


@dataclass
class TransformerConfig:
    vocab_size: int = 24
    max_source_seq_length: int = 32
    max_target_seq_length: int = 32
    d_model: int = 16
    attention_d_k: int = 16
    attention_d_v: int = 16
    head_num: int = 2
    d_feed_forward: int = 32
    encoder_layers: int = 2
    decoder_layers: int = 2
    dropout_ratio: float = 0.0
    learning_rate: float = 0.001
    weight_decay: float = 0.01
    clip_norm: float | None = 1.0


class PositionalEncoding:
    def __init__(self, max_length: int, d_model: int) -> None:
        self.max_length = max_length
        self.d_model = d_model
        self.pe = self._pe_calculation().to(device=current_device, dtype=torch.float32)

    def _pe_calculation(self) -> torch.Tensor:
        position = torch.arange(self.max_length).unsqueeze(1)
        i = torch.arange(self.d_model).unsqueeze(0)
        angles = position * (1 / torch.pow(10000, (2 * (i // 2)) / self.d_model))
        pe = torch.zeros((self.max_length, self.d_model))
        pe[:, 0::2] = torch.sin(angles[:, 0::2])
        pe[:, 1::2] = torch.cos(angles[:, 1::2])
        return pe

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[: x.size(1), :]


class PositionwiseFeedForward(torch.nn.Module):
    def __init__(self, d_model: int, d_feed_forward: int, dropout: float) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(d_model, d_feed_forward)
        self.linear2 = torch.nn.Linear(d_feed_forward, d_model)
        self.dropout = torch.nn.Dropout(p=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(torch.nn.functional.relu(self.linear1(x))))


class ScaleDotProductionAttention(torch.nn.Module):
    def forward(self, q, k, v, mask=None):
        head_dim = q.size(3)
        # (b, h, s, dK/h) @ (b, h, dK/h, s) -> (b, h, s, s)
        attention_weight = q @ k.transpose(-2, -1) / (head_dim**0.5)
        # pad mask
        if mask is not None:
            fill = float("-inf") if FIXED else float("-10000")
            attention_weight = attention_weight.masked_fill(mask == 0, fill)
        attention_score = torch.nn.functional.softmax(attention_weight, dim=-1)
        value = attention_score @ v
        return value


class MultiHeadAttention(torch.nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.spda = ScaleDotProductionAttention()
        self.Wq = torch.nn.Linear(config.d_model, config.attention_d_k)
        self.Wk = torch.nn.Linear(config.d_model, config.attention_d_k)
        self.Wv = torch.nn.Linear(config.d_model, config.attention_d_v)
        self.Wo = torch.nn.Linear(config.attention_d_v, config.d_model)
        self.dropout = torch.nn.Dropout(p=config.dropout_ratio)

    def forward(self, q, k, v, mask=None):
        batch_size = q.size(0)
        q, k, v = self.Wq(q), self.Wk(k), self.Wv(v)
        q_k_head_dim = self.config.attention_d_k // self.config.head_num
        v_head_dim = self.config.attention_d_v // self.config.head_num
        q = q.view(batch_size, q.size(1), self.config.head_num, q_k_head_dim).transpose(1, 2)
        k = k.view(batch_size, k.size(1), self.config.head_num, q_k_head_dim).transpose(1, 2)
        v = v.view(batch_size, v.size(1), self.config.head_num, v_head_dim).transpose(1, 2)
        spda_value = self.spda(q, k, v, mask)
        spda_value = spda_value.transpose(1, 2)
        spda_value = spda_value.contiguous().view(batch_size, spda_value.size(1), self.config.attention_d_v)
        output = self.Wo(spda_value)
        return output


class EncoderTransformerBlock(torch.nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.mha = MultiHeadAttention(config)
        self.ffn = PositionwiseFeedForward(config.d_model, config.d_feed_forward, config.dropout_ratio)
        self.layernorm_mha = torch.nn.LayerNorm(config.d_model)
        self.layernorm_ffn = torch.nn.LayerNorm(config.d_model)

    def forward(self, x, mask=None):
        h1 = self.mha(x, x, x, mask)
        y1 = self.layernorm_mha(x + h1)
        h2 = self.ffn(y1)
        return self.layernorm_ffn(y1 + h2)


class Encoder(torch.nn.Module):
    def __init__(self, config: TransformerConfig, padding_idx: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(config.vocab_size, config.d_model, padding_idx=padding_idx)
        self.pe = PositionalEncoding(config.max_source_seq_length, config.d_model)
        self.embedding_dropout = torch.nn.Dropout(p=config.dropout_ratio)
        self.layers = torch.nn.ModuleList([EncoderTransformerBlock(config) for _ in range(config.encoder_layers)])

    def forward(self, source_token_ids, mask=None):
        x = self.embedding_dropout(self.pe.apply(self.embedding(source_token_ids)))
        for layer in self.layers:
            x = layer(x, mask)
        return x


class DecoderTransformerBlock(torch.nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.causal_mha = MultiHeadAttention(config=config)
        self.cross_mha = MultiHeadAttention(config)
        self.ffn = PositionwiseFeedForward(config.d_model, config.d_feed_forward, config.dropout_ratio)
        self.layernorm_causal_mha = torch.nn.LayerNorm(config.d_model)
        self.layernorm_cross_mha = torch.nn.LayerNorm(config.d_model)
        self.layernorm_ffn = torch.nn.LayerNorm(config.d_model)

    def forward(self, x, encoder_output, source_mask=None, target_mask=None):
        h1 = self.causal_mha(x, x, x, target_mask)
        y1 = self.layernorm_causal_mha(x + h1)
        h2 = self.cross_mha(y1, encoder_output, encoder_output, source_mask)
        y2 = self.layernorm_cross_mha(y1 + h2)
        h3 = self.ffn(y2)
        return self.layernorm_ffn(y2 + h3)


class Decoder(torch.nn.Module):
    def __init__(self, config: TransformerConfig, padding_idx: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(config.vocab_size, config.d_model, padding_idx=padding_idx)
        self.pe = PositionalEncoding(config.max_target_seq_length, config.d_model)
        self.embedding_dropout = torch.nn.Dropout(p=config.dropout_ratio)
        self.layers = torch.nn.ModuleList([DecoderTransformerBlock(config) for _ in range(config.decoder_layers)])
        self.output_layer = torch.nn.Linear(config.d_model, config.vocab_size)

    def forward(self, target_input_ids, encoder_output, source_mask=None, target_mask=None):
        x = self.embedding_dropout(self.pe.apply(self.embedding(target_input_ids)))
        for layer in self.layers:
            x = layer(x, encoder_output, source_mask, target_mask)
        return self.output_layer(x)


class TransformerModel(torch.nn.Module):
    def __init__(self, config: TransformerConfig, padding_idx: int) -> None:
        super().__init__()
        self.config = config
        self.padding_idx = padding_idx
        self.encoder = Encoder(config=self.config, padding_idx=padding_idx)
        self.decoder = Decoder(config=self.config, padding_idx=padding_idx)
        self.device = current_device

    def forward(self, source_token_ids, target_token_ids):
        source_mask = self._get_source_mask(source_token_ids)
        target_mask = self._get_target_mask(target_token_ids)
        encoder_output = self.encoder(source_token_ids, source_mask)
        return self.decoder(target_token_ids, encoder_output, source_mask, target_mask)

    def _get_source_mask(self, source_token_ids):
        # shape: (batch_size, 1, 1, source_seq_length)
        return (source_token_ids != self.padding_idx).unsqueeze(1).unsqueeze(2)

    def _get_target_mask(self, target_token_ids):
        if FIXED:
            # shape: (batch_size, 1, 1, target_seq_length)
            pad_mask = (target_token_ids != self.padding_idx).unsqueeze(1).unsqueeze(2)
        else:
            # shape: (batch_size, 1, target_seq_length, 1)
            pad_mask = (target_token_ids != self.padding_idx).unsqueeze(1).unsqueeze(3)
        target_seq_length = target_token_ids.size(1)
        causal_mask = torch.tril(torch.ones((target_seq_length, target_seq_length), device=self.device)).bool()
        return pad_mask & causal_mask


# special tokens as the toynlp tokenizer orders them: [UNK], [BOS], [EOS], [PAD]
UNK, BOS, EOS, PAD = 0, 1, 2, 3


def collate_fn(batch):
    batch_input = [torch.tensor(src, dtype=torch.long) for src, _ in batch]
    batch_target = [torch.tensor(tgt, dtype=torch.long) for _, tgt in batch]
    return (pad_sequence(batch_input, padding_value=PAD, batch_first=True),
            pad_sequence(batch_target, padding_value=PAD, batch_first=True))


def main():
    torch.manual_seed(0)
    config = TransformerConfig()
    model = TransformerModel(config, PAD).to(current_device)
    criterion = torch.nn.CrossEntropyLoss(ignore_index=PAD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                  weight_decay=config.weight_decay)

    batch = [
        ([BOS, 5, 6, 7, 8, EOS], [BOS, 9, 10, EOS]),
        ([BOS, 11, 12, EOS], [BOS, 13, 14, 15, 16, 17, EOS]),
        ([BOS, 18, 19, 20, EOS], [BOS, 21, 22, 23, EOS]),
    ]
    input_batch, target_batch = collate_fn(batch)

    def calc_loss_batch(input_batch, target_batch):
        logits = model(input_batch, target_batch[:, :-1])
        pred = logits.reshape(-1, logits.shape[-1])
        loss = criterion(pred, target_batch[:, 1:].reshape(-1))
        return loss, logits

    model.train()
    for step in range(3):
        optimizer.zero_grad()
        loss, _ = calc_loss_batch(input_batch, target_batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        optimizer.step()
        print("step %d  loss %.6f" % (step, loss.item()))

    model.eval()
    with torch.no_grad():
        loss, logits = calc_loss_batch(input_batch, target_batch)
    print("eval loss %.6f" % loss.item())
    print("decoder logits, last position of each row:")
    for row in logits[:, -1, :4].tolist():
        print("  ", [round(x, 5) for x in row])
    print("mean |logit| over the batch: %.6f" % logits.abs().mean().item())


if __name__ == "__main__":
    main()
