"""Correct program (quiet batch quiet-r118a): a sentence-transformers v4 CrossEncoder fine-tuned for NLI.

Ported from UKPLab/sentence-transformers @85ec64559f4414aa536eca4bf53538291e0a333f:
  sentence_transformers/cross_encoder/CrossEncoder.py (CrossEncoder.forward -> self.model(...), CrossEncoder.predict:
      tokenizer(batch, padding=True, truncation=True, return_tensors="pt"), activation_fn, softmax),
  sentence_transformers/cross_encoder/data_collator.py (CrossEncoderDataCollator: text columns kept as lists),
  sentence_transformers/cross_encoder/trainer.py (collect_features) + trainer.py (compute_loss),
  sentence_transformers/cross_encoder/losses/CrossEntropyLoss.py (pairs tokenized per batch with padding=True),
  examples/cross_encoder/training/nli/training_nli.py (num_labels=3, premise/hypothesis/label columns).
The base model is a tiny BertForSequenceClassification (BertConfig, random weights, dropout 0) with a BERT WordPiece
tokenizer built from an in-memory vocab: each pair is [CLS] premise [SEP] hypothesis [SEP], token_type_ids 0 / 1,
right-padded to the longest pair of the batch (dynamic padding), truncation longest_first at model_max_length.

Checks (float64): every step's batch loss and gradients equal the mean over the pairs each tokenized and run alone
(no padding); after training, predict() on a padded batch equals each pair predicted alone, with sdpa and eager.
"""

import random

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

torch.manual_seed(0)
random.seed(0)

WORDS = (
    "a the man woman dog cat child is are was on in at park street sofa sleeping running playing eating "
    "outside inside red blue ball food nobody someone two people near with".split()
)
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS


class CrossEncoder(nn.Module):
    """The parts of sentence_transformers.cross_encoder.CrossEncoder used in training and predict()."""

    def __init__(self, model, tokenizer, activation_fn=None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.activation_fn = activation_fn or nn.Identity()

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def config(self):
        return self.model.config

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @torch.inference_mode()
    def predict(self, sentences, batch_size=32, apply_softmax=False, convert_to_tensor=True):
        input_was_singular = False
        if sentences and isinstance(sentences, (list, tuple)) and isinstance(sentences[0], str):
            sentences = [sentences]
            input_was_singular = True

        pred_scores = []
        self.eval()
        for start_index in range(0, len(sentences), batch_size):
            batch = sentences[start_index : start_index + batch_size]
            features = self.tokenizer(
                batch,
                padding=True,
                truncation=True,
                return_tensors="pt",
            )
            features.to(self.model.device)
            model_predictions = self.model(**features, return_dict=True)
            logits = self.activation_fn(model_predictions.logits)

            if apply_softmax and logits.ndim > 1:
                logits = torch.nn.functional.softmax(logits, dim=1)
            pred_scores.extend(logits)

        if self.config.num_labels == 1:
            pred_scores = [score[0] for score in pred_scores]
        if convert_to_tensor:
            pred_scores = torch.stack(pred_scores)
        if input_was_singular:
            pred_scores = pred_scores[0]
        return pred_scores


class CrossEncoderDataCollator:
    valid_label_columns = ["label", "labels", "score", "scores"]

    def __call__(self, features):
        column_names = list(features[0].keys())
        batch = {}
        for label_column in self.valid_label_columns:
            if label_column in column_names:
                batch["label"] = torch.tensor([row[label_column] for row in features])
                column_names.remove(label_column)
                break
        for column_name in column_names:
            batch[column_name] = [row[column_name] for row in features]
        return batch


class CrossEntropyLoss(nn.Module):
    def __init__(self, model: CrossEncoder, activation_fn: nn.Module = nn.Identity(), **kwargs) -> None:
        super().__init__()
        self.model = model
        self.activation_fn = activation_fn
        self.ce_loss = nn.CrossEntropyLoss(**kwargs)

    def forward(self, inputs: list[list[str]], labels: Tensor) -> Tensor:
        if len(inputs) != 2:
            raise ValueError(f"CrossEntropyLoss expects two non-label columns, got {len(inputs)}.")
        pairs = list(zip(inputs[0], inputs[1]))
        tokens = self.model.tokenizer(
            pairs,
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        tokens.to(self.model.device)
        logits = self.model(**tokens)[0]
        logits = self.activation_fn(logits)
        loss = self.ce_loss(logits, labels)
        return loss


def collect_features(inputs):
    labels = inputs.pop("label", None)
    features = list(inputs.values())
    return features, labels


def compute_loss(loss_fn, inputs):
    features, labels = collect_features(inputs)
    return loss_fn(features, labels)


def random_sentence(lo, hi):
    return " ".join(random.choice(WORDS) for _ in range(random.randint(lo, hi)))


def build(attn_implementation):
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}, model_max_length=24)
    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=0,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).double()
    return CrossEncoder(model, tokenizer)


def per_pair_loss_and_grads(model, loss_fn, rows):
    """Reference: each pair tokenized and run alone (batch of one, nothing padded); mean over pairs."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    grads = [torch.zeros_like(p) for p in params]
    for row in rows:
        model.zero_grad()
        loss = loss_fn([[row["premise"]], [row["hypothesis"]]], torch.tensor([row["label"]]))
        loss.backward()
        total += loss.item() / len(rows)
        for g, p in zip(grads, params):
            if p.grad is not None:
                g += p.grad / len(rows)
    model.zero_grad()
    return total, grads


def main():
    random.seed(0)
    train_dataset = [
        {"premise": random_sentence(2, 14), "hypothesis": random_sentence(1, 8), "label": random.randint(0, 2)}
        for _ in range(12)
    ]
    # one pair longer than model_max_length, so longest_first truncation cuts it in every batch it lands in
    train_dataset[5]["premise"] = random_sentence(22, 22)

    model = build("sdpa")
    loss_fn = CrossEntropyLoss(model)
    collator = CrossEncoderDataCollator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_batch_size = 4

    model.train()
    worst_loss, worst_grad, step = 0.0, 0.0, 0
    for epoch in range(2):
        order = list(range(len(train_dataset)))
        random.shuffle(order)
        for start in range(0, len(order), train_batch_size):
            rows = [train_dataset[i] for i in order[start : start + train_batch_size]]
            ref_loss, ref_grads = per_pair_loss_and_grads(model, loss_fn, rows)

            inputs = collator(rows)
            loss = compute_loss(loss_fn, inputs)
            loss.backward()
            params = [p for p in model.parameters() if p.requires_grad]
            worst_loss = max(worst_loss, abs(loss.item() - ref_loss))
            for g, p in zip(ref_grads, params):
                if p.grad is not None:
                    worst_grad = max(worst_grad, (p.grad - g).abs().max().item())
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 3 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
    print(f"train: max |batch loss - per-pair loss| {worst_loss:.2e}, max grad err {worst_grad:.2e}")
    assert worst_loss < 1e-10 and worst_grad < 1e-10

    state = model.model.state_dict()
    pairs = [(row["premise"], row["hypothesis"]) for row in train_dataset[:8]]
    for impl in ("sdpa", "eager"):
        ce = build(impl)
        ce.model.load_state_dict(state)
        batched = ce.predict(pairs, batch_size=4, apply_softmax=True)
        alone = torch.stack([ce.predict(pair, apply_softmax=True) for pair in pairs])
        err = (batched - alone).abs().max().item()
        print(f"predict ({impl}): max |batched - alone| {err:.2e}")
        assert err < 1e-10

    features = model.tokenizer(pairs[:4], padding=True, truncation=True, return_tensors="pt")
    print("token_type_ids of the first batch:\n", features["token_type_ids"])
    print("attention_mask of the first batch:\n", features["attention_mask"])


if __name__ == "__main__":
    main()
