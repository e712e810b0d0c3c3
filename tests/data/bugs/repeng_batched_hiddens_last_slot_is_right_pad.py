"""repeng: control-vector training read each sentence's hidden state at the batch's last slot.

Citation: vgel/repeng#38, commit 9c1c4c2 "Fix batched training on right-padded models (#38)";
file repeng/extract.py, ``batched_get_hiddens``.

The bug: ``ControlVector.train`` -> ``read_representations`` -> ``batched_get_hiddens`` tokenized
each batch with ``tokenizer(batch, padding=True)`` (GPT-2's tokenizer pads on the right, with
``pad_token_id = eos_token_id`` as repeng's tests set it) and kept ``batch[-1, :]`` of each row's
hidden states, so every sentence shorter than the batch's longest was represented by a padding
position. The PCA over positive-minus-negative differences then ran on those vectors.

The fix: take ``attention_mask[i].nonzero(as_tuple=True)[0][-1]`` (the last non-padding index)
for each row and read the hidden state there.

Ported at toy size: a random-weight GPT2LMHeadModel from GPT2Config, a word-level tokenizer that
pads right like GPT-2's, and a numpy stand-in for sklearn's ``PCA(n_components=1)``.
"""

import dataclasses
import sys
import typing

import numpy as np
import torch
from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv


class PCA:
    """Stands in for sklearn.decomposition.PCA (centre, SVD, svd_flip on U)."""

    def __init__(self, n_components=1, whiten=False):
        self.n_components = n_components

    def fit(self, X):
        X = np.asarray(X, dtype=np.float64)
        self.mean_ = X.mean(axis=0)
        U, S, Vt = np.linalg.svd(X - self.mean_, full_matrices=False)
        max_abs_cols = np.argmax(np.abs(U), axis=0)
        signs = np.sign(U[max_abs_cols, range(U.shape[1])])
        Vt *= signs[:, None]
        self.components_ = Vt[: self.n_components]
        return self


class ToyGPT2Tokenizer:
    """Word-level tokenizer padding on the right, like GPT2TokenizerFast with pad = eos."""

    padding_side = "right"

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.eos_token_id = vocab_size - 1
        self.pad_token_id = None
        self.vocab = {}

    def encode(self, text):
        ids = []
        for w in text.replace(".", " .").split():
            if w not in self.vocab:
                self.vocab[w] = len(self.vocab) % (self.vocab_size - 1)
            ids.append(self.vocab[w])
        return ids

    def __call__(self, batch, padding=False, return_tensors=None):
        rows = [self.encode(t) for t in batch]
        width = max(len(r) for r in rows)
        input_ids, attention_mask = [], []
        for r in rows:
            n_pad = width - len(r)
            input_ids.append(r + [self.pad_token_id] * n_pad)
            attention_mask.append([1] * len(r) + [0] * n_pad)
        return BatchEncoding({"input_ids": torch.tensor(input_ids),
                              "attention_mask": torch.tensor(attention_mask)})


def model_layer_list(model) -> torch.nn.ModuleList:
    if hasattr(model, "model"):  # mistral-like
        return model.model.layers
    elif hasattr(model, "transformer"):  # gpt-2-like
        return model.transformer.h
    else:
        raise ValueError(f"don't know how to get layer list for {type(model)}")


@dataclasses.dataclass
class DatasetEntry:
    positive: str
    negative: str


@dataclasses.dataclass
class ControlVector:
    model_type: str
    directions: dict

    @classmethod
    def train(cls, model, tokenizer, dataset, **kwargs) -> "ControlVector":
        dirs = read_representations(model, tokenizer, dataset, **kwargs)
        return cls(model_type=model.config.model_type, directions=dirs)


def read_representations(
    model,
    tokenizer,
    inputs: list,
    hidden_layers: typing.Iterable[int] | None = None,
    batch_size: int = 32,
    method: typing.Literal["pca_diff", "pca_center"] = "pca_diff",
) -> dict:
    """
    Extract the representations based on the contrast dataset.
    """
    if not hidden_layers:
        hidden_layers = range(-1, -model.config.num_hidden_layers, -1)

    # normalize the layer indexes if they're negative
    n_layers = len(model_layer_list(model))
    hidden_layers = [i if i >= 0 else n_layers + i for i in hidden_layers]

    # the order is [positive, negative, positive, negative, ...]
    train_strs = [s for ex in inputs for s in (ex.positive, ex.negative)]

    layer_hiddens = batched_get_hiddens(model, tokenizer, train_strs, hidden_layers, batch_size)

    # get directions for each layer using PCA
    directions: dict = {}
    for layer in hidden_layers:
        h = layer_hiddens[layer]
        assert h.shape[0] == len(inputs) * 2

        if method == "pca_diff":
            train = h[::2] - h[1::2]
        elif method == "pca_center":
            center = (h[::2] + h[1::2]) / 2
            train = h
            train[::2] -= center
            train[1::2] -= center
        else:
            raise ValueError("unknown method " + method)

        # shape (1, n_features)
        pca_model = PCA(n_components=1, whiten=False).fit(train)
        # shape (n_features,)
        directions[layer] = pca_model.components_.astype(np.float32).squeeze(axis=0)

        # calculate sign
        projected_hiddens = project_onto_direction(h, directions[layer])

        # order is [positive, negative, positive, negative, ...]
        positive_smaller_mean = np.mean(
            [projected_hiddens[i] < projected_hiddens[i + 1] for i in range(0, len(inputs) * 2, 2)]
        )
        positive_larger_mean = np.mean(
            [projected_hiddens[i] > projected_hiddens[i + 1] for i in range(0, len(inputs) * 2, 2)]
        )

        if positive_smaller_mean > positive_larger_mean:  # type: ignore
            directions[layer] *= -1

    return directions


def batched_get_hiddens(model, tokenizer, inputs: list, hidden_layers: list, batch_size: int) -> dict:
    """
    Using the given model and tokenizer, pass the inputs through the model and get the hidden
    states for each layer in `hidden_layers` for the last token.
    """
    batched_inputs = [inputs[p: p + batch_size] for p in range(0, len(inputs), batch_size)]
    hidden_states = {layer: [] for layer in hidden_layers}
    with torch.no_grad():
        for batch in batched_inputs:
            if not FIXED:
                out = model(
                    **tokenizer(batch, padding=True, return_tensors="pt").to(model.device),
                    output_hidden_states=True,
                )
                for layer in hidden_layers:
                    # if not indexing from end, account for embedding hiddens
                    hidden_idx = layer + 1 if layer >= 0 else layer
                    for batch in out.hidden_states[hidden_idx]:
                        hidden_states[layer].append(batch[-1, :].squeeze().cpu().numpy())
            else:
                # get the last token, handling right padding if present
                encoded_batch = tokenizer(batch, padding=True, return_tensors="pt")
                encoded_batch = encoded_batch.to(model.device)
                out = model(**encoded_batch, output_hidden_states=True)
                attention_mask = encoded_batch["attention_mask"]
                for i in range(len(batch)):
                    last_non_padding_index = attention_mask[i].nonzero(as_tuple=True)[0][-1].item()
                    for layer in hidden_layers:
                        hidden_idx = layer + 1 if layer >= 0 else layer
                        hidden_state = out.hidden_states[hidden_idx][i][last_non_padding_index].cpu().numpy()
                        hidden_states[layer].append(hidden_state)
            del out

    return {k: np.vstack(v) for k, v in hidden_states.items()}


def project_onto_direction(H, direction):
    """Project matrix H (n, d_1) onto direction vector (d_2,)"""
    mag = np.linalg.norm(direction)
    assert not np.isinf(mag)
    return (H @ direction) / mag


def make_dataset(template, positive_personas, negative_personas, suffix_list):
    dataset = []
    for suffix in suffix_list:
        for positive_persona, negative_persona in zip(positive_personas, negative_personas):
            dataset.append(
                DatasetEntry(
                    positive=template.format(persona=positive_persona) + f" {suffix}",
                    negative=template.format(persona=negative_persona) + f" {suffix}",
                )
            )
    return dataset


def main():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=95, eos_token_id=95)
    model = GPT2LMHeadModel(config).eval()
    tokenizer = ToyGPT2Tokenizer(config.vocab_size)
    tokenizer.pad_token_id = tokenizer.eos_token_id

    suffixes = [
        "I",
        "The weather",
        "Today I went to the",
        "My friend told me that she",
        "We walked along the river and then sat down by the",
        "He",
    ]
    happy_dataset = make_dataset(
        "You are feeling extremely {persona}.",
        ["happy", "joyful and bright"],
        ["sad", "miserable"],
        suffixes,
    )
    happy_vector = ControlVector.train(model, tokenizer, happy_dataset, method="pca_diff")

    train_strs = [s for ex in happy_dataset for s in (ex.positive, ex.negative)]
    for layer, direction in sorted(happy_vector.directions.items()):
        hs = batched_get_hiddens(model, tokenizer, train_strs, [layer], 32)[layer]
        proj = project_onto_direction(hs, direction)
        correct = np.mean([proj[i] > proj[i + 1] for i in range(0, len(proj), 2)])
        print(f"layer {layer}: direction[:5]={[round(float(x), 4) for x in direction[:5]]} "
              f"pos>neg on train pairs={correct:.2f}")
        print(f"   projections[:6]={[round(float(x), 3) for x in proj[:6]]}")


if __name__ == "__main__":
    main()
