# coastalcph/trldc#1 (fixed in commit 6343ac0, "seg_mask is not computed correctly"): the hierarchical long-document
# classifier (dainlp/models/cls/hierarchical.py) splits each document into segments, encodes them with RoBERTa and
# runs a segment-level transformer over the segments' <s> vectors. Padded (empty) segments were found with
# `torch.sum(input_ids, 2) != 0`, which assumes pad id 0; RoBERTa's pad id is 1, so every padded segment counted as
# real and got a segment position (and a sinusoidal position embedding) instead of position 0.
# Fix: `seg_mask = (torch.sum(attention_mask, 2) != 0)`.
import math
import sys
from types import SimpleNamespace

import torch
from transformers import RobertaConfig, RobertaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- dainlp/modules/utils.py ----
def get_sinusoidal_embeddings(num_embeddings, embedding_dim, padding_idx=None):
    assert embedding_dim % 2 == 0
    emb = math.log(10000) / (embedding_dim // 2 - 1)
    emb = torch.exp(torch.arange(embedding_dim // 2, dtype=torch.float) * -emb)
    emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
    if padding_idx is not None:
        emb[padding_idx, :] = 0
    return emb


# ---- dainlp/data/cls/hierarchical.py ----
class Collator:
    def __init__(self, tokenizer, segment_length=128, max_num_segments=256, do_use_stride=False,
                 add_cls_each_segment=False, task_name="singlelabel"):
        self.cls_token_id = tokenizer.cls_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.segment_length = segment_length
        self.add_cls_each_segment = add_cls_each_segment
        self.effective_segment_length = segment_length - 1 if add_cls_each_segment else segment_length
        self.max_num_segments = max_num_segments
        self.stride = int(segment_length / 8) if do_use_stride else 0
        self.task_name = task_name

    def convert_labels(self, features):
        return torch.tensor([f["labels"][0] for f in features], dtype=torch.int64)

    def __call__(self, features):
        max_seq_length = max([len(f["input_ids"]) for f in features])
        max_num_segments = math.ceil((max_seq_length - 2) / (self.effective_segment_length - self.stride))
        max_num_segments = min(max_num_segments, self.max_num_segments)

        batch = {"input_ids": [], "attention_mask": []}
        for f in features:
            input_ids, attention_mask = [], []
            start = 1  # due to the first [CLS] token
            for _ in range(max_num_segments):
                end = start + self.effective_segment_length
                if start > (len(f["input_ids"]) - self.stride):
                    # too short, add only pading tokens
                    input_ids += [self.pad_token_id] * self.segment_length
                    attention_mask += [0] * self.segment_length
                elif end > len(f["input_ids"]):
                    # the last segment
                    segment_ids = f["input_ids"][start:]
                    if self.add_cls_each_segment:
                        segment_ids = [self.cls_token_id] + segment_ids
                    attention_mask += [1] * len(segment_ids) + [0] * (self.segment_length - len(segment_ids))
                    input_ids += segment_ids
                    input_ids += [self.pad_token_id] * (self.segment_length - len(segment_ids))
                else:
                    if self.add_cls_each_segment:
                        input_ids += [self.cls_token_id] + f["input_ids"][start:end]
                    else:
                        input_ids += f["input_ids"][start:end]
                    attention_mask += [1] * self.segment_length
                assert len(input_ids) == len(attention_mask)
                start = end - self.stride

            batch["input_ids"].append(input_ids)
            batch["attention_mask"].append(attention_mask)
        batch = {k: torch.tensor(v, dtype=torch.int64) for k, v in batch.items()}
        batch["input_ids"] = batch["input_ids"].view(len(features), max_num_segments, self.segment_length)
        batch["attention_mask"] = batch["attention_mask"].view(len(features), max_num_segments, self.segment_length)
        batch["labels"] = self.convert_labels(features)
        return batch


# ---- dainlp/models/cls/hierarchical.py ----
class Model(torch.nn.Module):
    def __init__(self, config):
        super(Model, self).__init__()
        self.num_labels = config.num_labels
        self.config = config
        # pre-trained RoBERTa encoder, being able to take care of no longer than 512 wordpieces
        self.roberta = RobertaModel(config, add_pooling_layer=False)
        # Init sinusoidal positional embeddings
        self.seg_pos_embeddings = torch.nn.Embedding(config.max_segments + 1, config.hidden_size, padding_idx=0,
                                                     _weight=get_sinusoidal_embeddings(config.max_segments + 1,
                                                                                       config.hidden_size,
                                                                                       padding_idx=0))
        self.seg_encoder = torch.nn.Transformer(d_model=config.hidden_size, nhead=config.num_attention_heads,
                                                batch_first=True, dim_feedforward=config.intermediate_size,
                                                activation=config.hidden_act, dropout=config.hidden_dropout_prob,
                                                layer_norm_eps=config.layer_norm_eps, num_encoder_layers=2,
                                                num_decoder_layers=0).encoder
        self.dense = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = torch.nn.Dropout(config.hidden_dropout_prob)
        self.out_proj = torch.nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None):
        # Squash samples and segments into a single axis (batch_size * n_segments, max_segment_length)
        batch_size, n_segments, max_segment_length = input_ids.size()
        input_ids_reshape = input_ids.contiguous().view(-1, input_ids.size(-1))
        attention_mask_reshape = attention_mask.contiguous().view(-1, attention_mask.size(-1))
        if token_type_ids is None:
            token_type_ids_reshape = None
        else:
            token_type_ids_reshape = token_type_ids.contiguous().view(-1, token_type_ids.size(-1))

        # Encode segments with RoBERTa
        encoder_outputs = self.roberta(input_ids=input_ids_reshape, attention_mask=attention_mask_reshape,
                                       token_type_ids=token_type_ids_reshape)[0]

        # Reshape back to (batch_size, n_segments, max_segment_length, output_size)
        encoder_outputs = encoder_outputs.contiguous().view(batch_size, n_segments, max_segment_length,
                                                            self.config.hidden_size)

        # Gather CLS outputs per segment
        encoder_outputs = encoder_outputs[:, :, 0]

        # Infer real segments, i.e., mask paddings
        if FIXED:
            seg_mask = (torch.sum(attention_mask, 2) != 0).to(input_ids.dtype)
        else:
            seg_mask = (torch.sum(input_ids, 2) != 0).to(input_ids.dtype)
        # Infer and collect segment positional embeddings
        seg_positions = torch.arange(1, n_segments + 1).to(input_ids.device) * seg_mask
        # Add segment positional embeddings to segment inputs
        encoder_outputs += self.seg_pos_embeddings(seg_positions)
        # Encode segments with segment-wise transformer
        seg_encoder_outputs = self.seg_encoder(encoder_outputs)

        # Max pooling contextual segmental representations into document representation
        outputs, _ = torch.max(seg_encoder_outputs, 1)
        hidden_states = torch.tanh(self.dense(self.dropout(outputs)))
        logits = self.out_proj(self.dropout(hidden_states))

        loss_fct = torch.nn.CrossEntropyLoss()
        loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
        return {"loss": loss, "logits": logits}


def main():
    # RoBERTa's special ids: <s> = 0, <pad> = 1, </s> = 2
    tokenizer = SimpleNamespace(cls_token_id=0, pad_token_id=1, sep_token_id=2)
    config = RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    config.max_segments = 8
    config.task_name = "singlelabel"
    config.do_use_label_wise_attention = False

    g = torch.Generator().manual_seed(1)
    lengths = [50, 20, 9]  # documents of 48, 18 and 7 wordpieces between <s> and </s>
    features = []
    for i, n in enumerate(lengths):
        body = torch.randint(3, 100, (n - 2,), generator=g).tolist()
        features.append({"input_ids": [0] + body + [2], "labels": [i % 3]})

    collator = Collator(tokenizer, segment_length=8, max_num_segments=8, add_cls_each_segment=True)
    batch = collator(features)

    model = Model(config)
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    print("segments per document:", batch["input_ids"].shape[1])
    print("loss:", round(out["loss"].item(), 6))
    for i, row in enumerate(out["logits"]):
        print("doc", i, "logits", [round(v, 5) for v in row.tolist()], "pred", int(row.argmax()))


if __name__ == "__main__":
    main()
