# k-tahiro/bert-summarizer#36 (merges #35, commit 407e438, "Add tgt_mask not to use future tokens on
# generation process"), src/bert_summarizer/models/bertsum.py.
#
# BertSumAbs (abstractive summarization): a BERT encoder and BertSumAbsDecoder, a
# BertLMHeadModel whose body is torch's nn.TransformerDecoder (sequence-first) over
# PositionalEncoding'd target embeddings. Before the fix, BertSumAbsDecoder.forward called
# self.decoder(tgt, memory, tgt_key_padding_mask=..., memory_key_padding_mask=...) with no
# tgt_mask. The fix builds np.triu(np.ones((T, T)), k=1).astype(bool) and passes it as
# tgt_mask. Teacher-forced training and the generate loop (the whole prefix re-run each
# step, past_key_values=None) are both ported here, on a tiny config built in place.
import math
import sys
from logging import getLogger

import numpy as np
import torch
from torch import nn
from torch.nn.init import xavier_uniform_
from transformers import BertConfig, BertModel
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

FIXED = "--fixed" in sys.argv

logger = getLogger(__name__)


# src/bert_summarizer/models/embeddings.py
class PositionalEncoding(nn.Module):
    """https://pytorch.org/tutorials/beginner/transformer_tutorial.html"""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)

        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float()
                             * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer('pe', pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


# src/bert_summarizer/models/loss.py
class LabelSmoothingLoss(nn.Module):
    """https://github.com/pytorch/pytorch/issues/7455#issuecomment-513062631"""

    def __init__(self, classes: int, smoothing: float = 0.0, dim: int = -1):
        super(LabelSmoothingLoss, self).__init__()
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.cls = classes
        self.dim = dim

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred = pred.log_softmax(dim=self.dim)
        with torch.no_grad():
            true_dist = torch.zeros_like(pred)
            true_dist.fill_(self.smoothing / (self.cls - 1))
            true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        return torch.mean(torch.sum(-true_dist * pred, dim=self.dim))


# src/bert_summarizer/models/bertsum.py
class BertSumAbsDecoder(nn.Module):
    # The project subclasses BertLMHeadModel and calls
    # super(BertPreTrainedModel, self).__init__(config); the layers are the same.
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config

        self.embeddings = nn.Sequential(
            nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                padding_idx=config.pad_token_id,
            ),
            PositionalEncoding(
                config.hidden_size,
                dropout=config.hidden_dropout_prob
            )
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(
                config.hidden_size,
                config.num_attention_heads,
                dim_feedforward=config.intermediate_size,
                dropout=config.attention_probs_dropout_prob,
                activation=config.hidden_act,
            ),
            config.num_hidden_layers,
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        )
        self.generator = nn.Sequential(
            nn.Linear(config.hidden_size, config.vocab_size),
            nn.LogSoftmax(dim=-1)
        )

        self.loss = LabelSmoothingLoss(
            config.vocab_size,
            0.1
        )

        for p in self.decoder.parameters():
            if p.dim() > 1:
                xavier_uniform_(p)

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings[0]

    def set_input_embeddings(self, embeddings: nn.Embedding):
        self.embeddings[0] = embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        labels=None,
        return_dict=None,
        **kwargs
    ):
        tgt = self.embeddings(input_ids).transpose(0, 1)
        memory = encoder_hidden_states.transpose(0, 1)
        if FIXED:
            tgt_mask = torch.from_numpy(
                np.triu(
                    np.ones((tgt.size(0), tgt.size(0))),
                    k=1
                ).astype(bool)
            )
        tgt_key_padding_mask = attention_mask ^ True
        memory_key_padding_mask = encoder_attention_mask ^ True

        if FIXED:
            output = self.decoder(
                tgt,
                memory,
                tgt_mask=tgt_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask
            )
        else:
            output = self.decoder(
                tgt,
                memory,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask
            )

        # transformers style loss calculation
        decoder_outputs = output.transpose(0, 1)
        prediction_scores = self.generator[0](decoder_outputs)

        lm_loss = None
        if labels is not None:
            # we are doing next-token prediction; shift prediction scores and input ids by one
            shifted_prediction_scores = prediction_scores[:, :-1, :] \
                .contiguous()
            labels = labels[:, 1:].contiguous()

            output = self.generator[1](
                shifted_prediction_scores
            ).view(-1, self.config.vocab_size)
            target = labels.view(-1)

            normalization = target.ne(self.config.pad_token_id).sum().item()

            lm_loss = self.loss(output, target).div(float(normalization))

        return CausalLMOutputWithCrossAttentions(
            loss=lm_loss,
            logits=prediction_scores,
        )


class BertSumAbs(nn.Module):
    """EncoderDecoderModel(encoder=BertModel, decoder=BertSumAbsDecoder), its forward as
    transformers' EncoderDecoderModel runs it: the encoder's attention_mask is handed to
    the decoder as encoder_attention_mask."""

    def __init__(self, encoder_config: BertConfig, decoder_config: BertConfig):
        super().__init__()
        self.encoder = BertModel(encoder_config, add_pooling_layer=False)
        self.decoder = BertSumAbsDecoder(decoder_config)
        self.decoder.set_input_embeddings(self.encoder.get_input_embeddings())

    def forward(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask,
                labels=None, encoder_outputs=None):
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        return self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs[0],
            encoder_attention_mask=attention_mask,
            labels=labels,
        ), encoder_outputs


def main():
    torch.manual_seed(0)
    PAD, CLS, SEP = 0, 1, 2
    enc_cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, pad_token_id=PAD)
    dec_cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, hidden_act="gelu", layer_norm_eps=1e-6,
                         pad_token_id=PAD, is_decoder=True, add_cross_attention=True)
    model = BertSumAbs(enc_cfg, dec_cfg).eval()

    # EncoderDecoderDataCollatorWithPadding(generate_labels=True): right-padded sources and
    # summaries, labels = decoder_input_ids; masks as bools (the decoder XORs them with True).
    src = [[CLS, 11, 12, 13, 14, 15, 16, SEP], [CLS, 21, 22, 23, SEP]]
    tgt = [[CLS, 31, 32, 33, 34, SEP], [CLS, 41, 42, SEP]]

    def pad(rows):
        L = max(len(r) for r in rows)
        ids = torch.tensor([r + [PAD] * (L - len(r)) for r in rows])
        return ids, ids.ne(PAD)

    input_ids, attention_mask = pad(src)
    decoder_input_ids, decoder_attention_mask = pad(tgt)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask,
                 decoder_input_ids=decoder_input_ids,
                 decoder_attention_mask=decoder_attention_mask,
                 labels=decoder_input_ids)

    with torch.no_grad():
        out, _ = model(**batch)
    print("teacher-forced loss:", round(out.loss.item(), 6))
    print("logits at step 1, row 0 (first 5):", out.logits[0, 1, :5].tolist())

    # generate(): no past_key_values, so the whole summary prefix is re-run each step.
    with torch.no_grad():
        enc = model.encoder(input_ids=input_ids, attention_mask=attention_mask)
        gen = torch.full((input_ids.size(0), 1), CLS, dtype=torch.long)
        for _ in range(6):
            dec_mask = torch.ones_like(gen, dtype=torch.bool)
            step_out, _ = model(input_ids, attention_mask, gen, dec_mask, encoder_outputs=enc)
            next_tok = step_out.logits[:, -1, :].argmax(-1, keepdim=True)
            gen = torch.cat([gen, next_tok], dim=1)
    print("generated:", gen.tolist())


if __name__ == "__main__":
    main()
