# Correct program (quiet batch quiet-r130b): fine-tuning a BGE-style sentence embedder with FlagEmbedding.
# Ported from FlagOpen/FlagEmbedding:
#   FlagEmbedding/finetune/embedder/encoder_only/base/modeling.py @0dff36cd1fc1d63dd39bf209e87cfa1ba83dc74d
#     (BiEncoderOnlyEmbedderModel: encode with and without sub-batches, _sentence_embedding "mean" =
#     sum(last_hidden_state * attention_mask) / attention_mask.sum, normalize_embeddings, compute_score / temperature,
#     compute_loss = CrossEntropyLoss),
#   FlagEmbedding/abc/finetune/embedder/AbsModeling.py @0dff36cd1fc1d63dd39bf209e87cfa1ba83dc74d
#     (AbsEmbedderModel.forward, _compute_in_batch_neg_loss with targets idxs * group_size,
#     _compute_no_in_batch_neg_loss / get_local_score),
#   FlagEmbedding/abc/finetune/embedder/AbsDataset.py @1b971d023e53904d2e35d96b6a99721715e063ed
#     (AbsEmbedderTrainDataset.__getitem__: one positive + train_group_size - 1 negatives; AbsEmbedderCollator:
#     DataCollatorWithPadding, tokenizer.pad of queries and passages, whole or in sub-batches).
# The base model is a tiny BertConfig built in memory (random init) and the tokenizer a BertTokenizerFast over a small
# word vocabulary written to a temporary directory; padding is on the right (BERT's default). The collator's
# attention_mask goes to BertModel and again to the mean pooling.
# Self-check: every query and passage encoded alone, unpadded, is the reference embedding; the batched embeddings
# (whole and in sub-batches), the in-batch-negative loss and the no-in-batch-negative loss must match a loop over
# the references; a few AdamW steps must lower the loss.
import math
import os
import random
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, BertModel, BertTokenizerFast, DataCollatorWithPadding
from transformers.file_utils import ModelOutput

random.seed(0)
torch.manual_seed(0)


# --- FlagEmbedding/abc/finetune/embedder/AbsModeling.py ---
@dataclass
class EmbedderOutput(ModelOutput):
    q_reps: Optional[Tensor] = None
    p_reps: Optional[Tensor] = None
    loss: Optional[Tensor] = None
    scores: Optional[Tensor] = None


class AbsEmbedderModel(nn.Module):
    def __init__(self, base_model, tokenizer=None, negatives_cross_device=False, temperature=1.0,
                 sub_batch_size=-1, kd_loss_type='kl_div'):
        super().__init__()
        self.model = base_model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.negatives_cross_device = negatives_cross_device
        self.sub_batch_size = sub_batch_size
        self.kd_loss_type = kd_loss_type

    def get_local_score(self, q_reps, p_reps, all_scores):
        group_size = p_reps.size(0) // q_reps.size(0)
        indices = torch.arange(0, q_reps.size(0), device=q_reps.device) * group_size
        specific_scores = []
        for i in range(group_size):
            specific_scores.append(
                all_scores[torch.arange(q_reps.size(0), device=q_reps.device), indices + i]
            )
        return torch.stack(specific_scores, dim=1).view(q_reps.size(0), -1)

    def compute_local_score(self, q_reps, p_reps, compute_score_func=None, **kwargs):
        if compute_score_func is None:
            all_scores = self.compute_score(q_reps, p_reps)
        else:
            all_scores = compute_score_func(q_reps, p_reps, **kwargs)
        loacl_scores = self.get_local_score(q_reps, p_reps, all_scores)
        return loacl_scores

    def _compute_no_in_batch_neg_loss(self, q_reps, p_reps, teacher_targets=None, compute_score_func=None, **kwargs):
        local_scores = self.compute_local_score(q_reps, p_reps, compute_score_func, **kwargs)  # (batch_size, group_size)
        local_targets = torch.zeros(local_scores.size(0), device=local_scores.device, dtype=torch.long)
        loss = self.compute_loss(local_scores, local_targets)
        return local_scores, loss

    def _compute_in_batch_neg_loss(self, q_reps, p_reps, teacher_targets=None, compute_score_func=None, **kwargs):
        group_size = p_reps.size(0) // q_reps.size(0)
        if compute_score_func is None:
            scores = self.compute_score(q_reps, p_reps)  # (batch_size, batch_size * group_size)
        else:
            scores = compute_score_func(q_reps, p_reps, **kwargs)
        idxs = torch.arange(q_reps.size(0), device=q_reps.device, dtype=torch.long)
        targets = idxs * group_size  # (batch_size)
        loss = self.compute_loss(scores, targets)
        return scores, loss

    def forward(
        self,
        queries: Union[Dict[str, Tensor], List[Dict[str, Tensor]]] = None,
        passages: Union[Dict[str, Tensor], List[Dict[str, Tensor]]] = None,
        teacher_scores: Union[None, List[float]] = None,
        no_in_batch_neg_flag: bool = False,
    ):
        q_reps = self.encode(queries)  # (batch_size, dim)
        p_reps = self.encode(passages)  # (batch_size * group_size, dim)

        if self.training:
            teacher_targets = None
            if no_in_batch_neg_flag:
                compute_loss_func = self._compute_no_in_batch_neg_loss
            else:
                compute_loss_func = self._compute_in_batch_neg_loss
            scores, loss = compute_loss_func(q_reps, p_reps, teacher_targets=teacher_targets)
        else:
            loss = None

        return EmbedderOutput(loss=loss)


# --- FlagEmbedding/finetune/embedder/encoder_only/base/modeling.py ---
class BiEncoderOnlyEmbedderModel(AbsEmbedderModel):
    def __init__(self, base_model, tokenizer=None, negatives_cross_device=False, temperature=1.0,
                 sub_batch_size=-1, kd_loss_type='kl_div', sentence_pooling_method='cls',
                 normalize_embeddings=False):
        super().__init__(
            base_model,
            tokenizer=tokenizer,
            negatives_cross_device=negatives_cross_device,
            temperature=temperature,
            sub_batch_size=sub_batch_size,
            kd_loss_type=kd_loss_type,
        )
        self.sentence_pooling_method = sentence_pooling_method
        self.normalize_embeddings = normalize_embeddings
        self.cross_entropy = torch.nn.CrossEntropyLoss(reduction='mean')

    def encode(self, features):
        if features is None:
            return None
        if not isinstance(features, list):
            if self.sub_batch_size is not None and self.sub_batch_size > 0:
                all_p_reps = []
                for i in range(0, len(features['attention_mask']), self.sub_batch_size):
                    end_inx = min(i + self.sub_batch_size, len(features['attention_mask']))
                    sub_features = {}
                    for k, v in features.items():
                        sub_features[k] = v[i:end_inx]
                    last_hidden_state = self.model(**sub_features, return_dict=True).last_hidden_state
                    p_reps = self._sentence_embedding(last_hidden_state, sub_features['attention_mask'])
                    all_p_reps.append(p_reps)
                all_p_reps = torch.cat(all_p_reps, 0).contiguous()
                if self.normalize_embeddings:
                    all_p_reps = torch.nn.functional.normalize(all_p_reps, dim=-1)
                return all_p_reps.contiguous()
            else:
                last_hidden_state = self.model(**features, return_dict=True).last_hidden_state
                all_p_reps = self._sentence_embedding(last_hidden_state, features['attention_mask'])
                if self.normalize_embeddings:
                    all_p_reps = torch.nn.functional.normalize(all_p_reps, dim=-1)
                return all_p_reps.contiguous()
        else:
            all_p_reps = []
            for sub_features in features:
                last_hidden_state = self.model(**sub_features, return_dict=True).last_hidden_state
                p_reps = self._sentence_embedding(last_hidden_state, sub_features['attention_mask'])
                all_p_reps.append(p_reps)
            all_p_reps = torch.cat(all_p_reps, 0).contiguous()
            if self.normalize_embeddings:
                all_p_reps = torch.nn.functional.normalize(all_p_reps, dim=-1)
            return all_p_reps.contiguous()

    def _sentence_embedding(self, last_hidden_state, attention_mask):
        if self.sentence_pooling_method == "cls":
            return last_hidden_state[:, 0]
        elif self.sentence_pooling_method == "mean":
            s = torch.sum(
                last_hidden_state * attention_mask.unsqueeze(-1).float(), dim=1
            )
            d = attention_mask.sum(dim=1, keepdim=True).float()
            return s / d
        elif self.sentence_pooling_method == "last_token":
            left_padding = attention_mask[:, -1].sum() == attention_mask.shape[0]
            if left_padding:
                return last_hidden_state[:, -1]
            else:
                sequence_lengths = attention_mask.sum(dim=1) - 1
                batch_size = last_hidden_state.shape[0]
                return last_hidden_state[
                    torch.arange(batch_size, device=last_hidden_state.device),
                    sequence_lengths,
                ]
        else:
            raise NotImplementedError(f"pooling method {self.sentence_pooling_method} not implemented")

    def compute_score(self, q_reps, p_reps):
        scores = self._compute_similarity(q_reps, p_reps) / self.temperature
        scores = scores.view(q_reps.size(0), -1)
        return scores

    def _compute_similarity(self, q_reps, p_reps):
        if len(p_reps.size()) == 2:
            return torch.matmul(q_reps, p_reps.transpose(0, 1))
        return torch.matmul(q_reps, p_reps.transpose(-2, -1))

    def compute_loss(self, scores, target):
        return self.cross_entropy(scores, target)


# --- FlagEmbedding/abc/finetune/embedder/AbsDataset.py (data held in memory instead of jsonl files) ---
@dataclass
class DataArgs:
    train_group_size: int = 3
    query_instruction_for_retrieval: Optional[str] = "represent this sentence for searching relevant passages:"
    query_instruction_format: str = "{} {}"
    passage_instruction_for_retrieval: Optional[str] = None
    passage_instruction_format: str = "{} {}"


class AbsEmbedderTrainDataset(torch.utils.data.Dataset):
    def __init__(self, args, tokenizer, dataset):
        self.args = args
        self.tokenizer = tokenizer
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, item):
        data = self.dataset[item]
        train_group_size = self.args.train_group_size

        query = data['query']
        if self.args.query_instruction_for_retrieval is not None:
            query = self.args.query_instruction_format.format(
                data['prompt'] if 'prompt' in data else self.args.query_instruction_for_retrieval,
                query
            )

        passages = []
        pos_idx = random.choice(list(range(len(data['pos']))))
        passages.append(data['pos'][pos_idx])

        neg_all_idx = list(range(len(data['neg'])))
        if len(data['neg']) < train_group_size - 1:
            num = math.ceil((train_group_size - 1) / len(data['neg']))
            neg_idxs = random.sample(neg_all_idx * num, train_group_size - 1)
        else:
            neg_idxs = random.sample(neg_all_idx, self.args.train_group_size - 1)
        for neg_idx in neg_idxs:
            passages.append(data['neg'][neg_idx])

        return query, passages, None


@dataclass
class AbsEmbedderCollator(DataCollatorWithPadding):
    query_max_len: int = 32
    passage_max_len: int = 128
    sub_batch_size: int = -1

    def __call__(self, features):
        queries = [f[0] for f in features]
        passages = [f[1] for f in features]
        teacher_scores = [f[2] for f in features]
        if teacher_scores[0] is None:
            teacher_scores = None

        if isinstance(queries[0], list):
            queries = sum(queries, [])
        if isinstance(passages[0], list):
            passages = sum(passages, [])

        queries_inputs = self.tokenizer(queries, truncation=True, max_length=self.query_max_len, return_tensors=None)
        passages_inputs = self.tokenizer(passages, truncation=True, max_length=self.passage_max_len,
                                         return_tensors=None)

        if self.sub_batch_size is None or self.sub_batch_size <= 0:
            q_collated = self.tokenizer.pad(
                queries_inputs,
                padding=self.padding,
                max_length=self.query_max_len,
                pad_to_multiple_of=self.pad_to_multiple_of,
                return_tensors=self.return_tensors
            )
            d_collated = self.tokenizer.pad(
                passages_inputs,
                padding=self.padding,
                max_length=self.passage_max_len,
                pad_to_multiple_of=self.pad_to_multiple_of,
                return_tensors=self.return_tensors
            )
        else:
            batch_size = self.sub_batch_size

            q_collated = []
            for i in range(0, len(queries_inputs['attention_mask']), batch_size):
                start = i
                end = min(len(queries_inputs['attention_mask']), i + batch_size)
                sub_features = {}
                for k, v in queries_inputs.items():
                    sub_features[k] = v[start:end]
                q_collated.append(self.tokenizer.pad(
                    sub_features,
                    padding=self.padding,
                    max_length=self.passage_max_len,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                    return_tensors=self.return_tensors
                ))

            d_collated = []
            for i in range(0, len(passages_inputs['attention_mask']), batch_size):
                start = i
                end = min(len(passages_inputs['attention_mask']), i + batch_size)
                sub_features = {}
                for k, v in passages_inputs.items():
                    sub_features[k] = v[start:end]
                d_collated.append(self.tokenizer.pad(
                    sub_features,
                    padding=self.padding,
                    max_length=self.passage_max_len,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                    return_tensors=self.return_tensors
                ))
        return {
            "queries": q_collated,
            "passages": d_collated,
            "teacher_scores": teacher_scores,
            "no_in_batch_neg_flag": False
        }


# --- a tiny in-memory setup ---
TRAIN_DATA = [
    {"query": "what is a cat",
     "pos": ["a cat is a small furry animal that people keep as a pet at home"],
     "neg": ["the river runs to the sea", "a car has four wheels and an engine", "rain falls from clouds"]},
    {"query": "how do cars move",
     "pos": ["a car moves when its engine turns the wheels"],
     "neg": ["a cat sleeps", "the sun is a star that gives light and heat to the earth", "bread is made of flour"]},
    {"query": "where does rain come from",
     "pos": ["rain falls from clouds when the water in them gets heavy"],
     "neg": ["a dog barks at night", "the engine of a car burns fuel"]},
    {"query": "why is the sun hot",
     "pos": ["the sun is a star and it burns hydrogen"],
     "neg": ["a cat is a pet", "flour and water make bread when it is baked in an oven for an hour", "rivers"]},
]


def build_tokenizer(tmpdir):
    words = sorted({w for d in TRAIN_DATA for t in [d["query"]] + d["pos"] + d["neg"] for w in t.split()}
                   | set(DataArgs.query_instruction_for_retrieval.replace(":", " :").split()))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    path = os.path.join(tmpdir, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizerFast(path, do_lower_case=True)


def reference_embedding(base_model, tokenizer, text, max_length):
    """One text alone, unpadded: mean of its hidden states over all its tokens, L2-normalised."""
    enc = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
    hidden = base_model(input_ids=enc["input_ids"], token_type_ids=enc["token_type_ids"]).last_hidden_state[0]
    return F.normalize(hidden.mean(dim=0), dim=-1)


def main():
    with tempfile.TemporaryDirectory() as tmpdir:
        tokenizer = build_tokenizer(tmpdir)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    base_model = BertModel(config, add_pooling_layer=False)
    model = BiEncoderOnlyEmbedderModel(base_model, tokenizer=tokenizer, temperature=0.02,
                                       sentence_pooling_method="mean", normalize_embeddings=True)

    args = DataArgs()
    train_dataset = AbsEmbedderTrainDataset(args, tokenizer, TRAIN_DATA)
    collator = AbsEmbedderCollator(tokenizer, padding=True, return_tensors="pt", query_max_len=16,
                                   passage_max_len=12)
    sub_collator = AbsEmbedderCollator(tokenizer, padding=True, return_tensors="pt", query_max_len=16,
                                       passage_max_len=12, sub_batch_size=3)

    features = [train_dataset[i] for i in range(len(train_dataset))]
    batch = collator(features)
    sub_batch = sub_collator(features)
    q_mask, p_mask = batch["queries"]["attention_mask"], batch["passages"]["attention_mask"]
    assert (q_mask[:, 0] == 1).all() and (q_mask.sum(1) < q_mask.shape[1]).any(), "queries right-padded"
    assert (p_mask.sum(1) < p_mask.shape[1]).any(), "passages right-padded"
    assert int(p_mask.sum(1).max()) == 12, "a long passage is truncated to passage_max_len"

    queries = [f[0] for f in features]
    passages = sum([f[1] for f in features], [])
    group_size = args.train_group_size

    model.eval()
    with torch.no_grad():
        q_reps = model.encode(batch["queries"])
        p_reps = model.encode(batch["passages"])
        q_ref = torch.stack([reference_embedding(base_model, tokenizer, q, 16) for q in queries])
        p_ref = torch.stack([reference_embedding(base_model, tokenizer, p, 12) for p in passages])
        err_q = (q_reps - q_ref).abs().max().item()
        err_p = (p_reps - p_ref).abs().max().item()
        assert err_q < 1e-5 and err_p < 1e-5, (err_q, err_p)

        # sub-batches: the collator's list of padded chunks, and the model splitting one padded batch itself
        err_list = (model.encode(sub_batch["passages"]) - p_ref).abs().max().item()
        model.sub_batch_size = 5
        err_split = (model.encode(batch["passages"]) - p_ref).abs().max().item()
        model.sub_batch_size = -1
        assert err_list < 1e-5 and err_split < 1e-5, (err_list, err_split)

        # whatever id sits in the padded slots, the embeddings stay the same
        noisy = {k: v.clone() for k, v in batch["passages"].items()}
        noisy["input_ids"][p_mask == 0] = tokenizer.convert_tokens_to_ids("engine")
        err_noise = (model.encode(noisy) - p_reps).abs().max().item()
        assert err_noise < 1e-5, err_noise

    # losses against a loop over the unpadded references
    model.train()
    with torch.no_grad():
        loss_in_batch = model(**batch).loss.item()
        loss_local = model(queries=batch["queries"], passages=batch["passages"], no_in_batch_neg_flag=True).loss.item()
        loss_sub = model(**sub_batch).loss.item()
    ref_in_batch, ref_local = 0.0, 0.0
    for i in range(len(queries)):
        scores = torch.stack([q_ref[i] @ p_ref[j] for j in range(len(passages))]) / model.temperature
        ref_in_batch += -torch.log_softmax(scores, dim=0)[i * group_size].item()
        own = scores[i * group_size:(i + 1) * group_size]
        ref_local += -torch.log_softmax(own, dim=0)[0].item()
    ref_in_batch /= len(queries)
    ref_local /= len(queries)
    assert abs(loss_in_batch - ref_in_batch) < 1e-3, (loss_in_batch, ref_in_batch)
    assert abs(loss_sub - ref_in_batch) < 1e-3, (loss_sub, ref_in_batch)
    assert abs(loss_local - ref_local) < 1e-3, (loss_local, ref_local)

    # a few training steps on fresh batches (a new positive / negatives drawn each step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(8):
        batch = collator([train_dataset[i] for i in range(len(train_dataset))])
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses

    print(f"embeddings vs unpadded singles: queries {err_q:.2e}, passages {err_p:.2e}; "
          f"sub-batches {err_list:.2e} / {err_split:.2e}; pad ids {err_noise:.2e}")
    print(f"in-batch loss {loss_in_batch:.4f} (ref {ref_in_batch:.4f}), sub-batched {loss_sub:.4f}, "
          f"no-in-batch {loss_local:.4f} (ref {ref_local:.4f})")
    print(f"training loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("ok")


if __name__ == "__main__":
    main()
