"""MIDI-BERT (wazenmai/MIDI-BERT): note-level melody extraction on compound-word (CP) MIDI with padded pieces.

Follows wazenmai/MIDI-BERT MidiBERT/model.py @230b984982a61537bfaf65947851cefb02343cc3 (Embeddings, MidiBert:
four token-type embeddings [Bar, Position, Pitch, Duration] concatenated, in_linear, then
`self.bert(inputs_embeds=emb_linear, attention_mask=attn_mask, output_hidden_states=...)`),
MidiBERT/finetune_model.py @230b984982a61537bfaf65947851cefb02343cc3 (TokenClassification reads
`hidden_states[layer]`) and MidiBERT/finetune_trainer.py @1bc4cab67d2e8c09c8e4e96b34e4e2adc8fde5b8
(FinetuneTrainer.iteration / compute_loss for token-level tasks). transformers' BertModel from a tiny BertConfig
built as MidiBERT/main.py builds it (position_embedding_type='relative_key_query', which the installed
transformers 5 BertModel no longer implements: it uses absolute positions; right padding changes neither).

Each piece is a run of CP words right-padded with the pad word of every token type ('Bar <PAD>', ...) to
max_seq_len (512 in the project, 32 here); its note labels (1 melody, 2 bridge, 3 accompaniment) are padded with 0.
For token-level tasks the trainer builds `attn = (y != 0).float()` ("avoid attend to pad word"), passes it as
BertModel's attention_mask, and weights the per-token CrossEntropyLoss and the accuracy by the same `attn`.

Checked (eval mode): every real note's hidden states (the layer read and the last), its class logits and argmax
equal the piece run alone at its own length with an all-ones mask, and the batch loss / accuracy equal a double
loop over pieces x real notes.
"""
import math
import random

import numpy as np
import torch
import torch.nn as nn
from transformers import BertConfig, BertModel


class Embeddings(nn.Module):
    def __init__(self, n_token, d_model):
        super().__init__()
        self.lut = nn.Embedding(n_token, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model)


# BERT model: similar approach to "felix"
class MidiBert(nn.Module):
    def __init__(self, bertConfig, e2w, w2e):
        super().__init__()

        self.bert = BertModel(bertConfig)
        bertConfig.d_model = bertConfig.hidden_size
        self.hidden_size = bertConfig.hidden_size
        self.bertConfig = bertConfig

        # token types: [Bar, Position, Pitch, Duration]
        self.n_tokens = []
        self.classes = ['Bar', 'Position', 'Pitch', 'Duration']
        for key in self.classes:
            self.n_tokens.append(len(e2w[key]))
        self.emb_sizes = [256, 256, 256, 256]
        self.e2w = e2w
        self.w2e = w2e

        # for deciding whether the current input_ids is a <PAD> token
        self.bar_pad_word = self.e2w['Bar']['Bar <PAD>']
        self.mask_word_np = np.array([self.e2w[etype]['%s <MASK>' % etype] for etype in self.classes], dtype=np.long)
        self.pad_word_np = np.array([self.e2w[etype]['%s <PAD>' % etype] for etype in self.classes], dtype=np.long)

        # word_emb: embeddings to change token ids into embeddings
        self.word_emb = []
        for i, key in enumerate(self.classes):
            self.word_emb.append(Embeddings(self.n_tokens[i], self.emb_sizes[i]))
        self.word_emb = nn.ModuleList(self.word_emb)

        # linear layer to merge embeddings from different token types
        self.in_linear = nn.Linear(np.sum(self.emb_sizes), bertConfig.d_model)

    def forward(self, input_ids, attn_mask=None, output_hidden_states=True):
        # convert input_ids into embeddings and merge them through linear layer
        embs = []
        for i, key in enumerate(self.classes):
            embs.append(self.word_emb[i](input_ids[..., i]))
        embs = torch.cat([*embs], dim=-1)
        emb_linear = self.in_linear(embs)

        # feed to bert
        y = self.bert(inputs_embeds=emb_linear, attention_mask=attn_mask, output_hidden_states=output_hidden_states)
        return y


class TokenClassification(nn.Module):
    def __init__(self, midibert, class_num, hs):
        super().__init__()

        self.midibert = midibert
        self.classifier = nn.Sequential(
            nn.Dropout(0.1),
            nn.Linear(hs, 256),
            nn.ReLU(),
            nn.Linear(256, class_num)
        )

    def forward(self, y, attn, layer):
        # feed to bert
        y = self.midibert(y, attn, output_hidden_states=True)
        y = y.hidden_states[layer]
        return self.classifier(y)


class FinetuneTrainer:
    """The token-level path of FinetuneTrainer.iteration (no optimizer step: evaluation)."""

    def __init__(self, model, layer):
        self.model = model
        self.layer = layer
        self.loss_func = nn.CrossEntropyLoss(reduction='none')

    def compute_loss(self, predict, target, loss_mask, seq):
        loss = self.loss_func(predict, target)
        if not seq:
            loss = loss * loss_mask
            loss = torch.sum(loss) / torch.sum(loss_mask)
        else:
            loss = torch.sum(loss) / loss.shape[0]
        return loss

    def iteration(self, training_data, seq=False):
        total_acc, total_cnt, total_loss = 0, 0, 0
        all_y_hat = []
        for x, y in training_data:
            # avoid attend to pad word
            if not seq:
                attn = (y != 0).float()   # (batch,512)
            else:
                attn = torch.ones((x.shape[0], x.shape[1]))

            y_hat = self.model.forward(x, attn, self.layer)
            all_y_hat.append(y_hat)

            output = np.argmax(y_hat.cpu().detach().numpy(), axis=-1)
            output = torch.from_numpy(output)

            if not seq:
                acc = torch.sum((y == output).float() * attn)
                total_acc += acc
                total_cnt += torch.sum(attn).item()

            if not seq:
                y_hat = y_hat.permute(0, 2, 1)
            loss = self.compute_loss(y_hat, y, attn, seq)
            total_loss += loss.item()

        return total_loss / len(training_data), total_acc.item() / total_cnt, all_y_hat


def make_dictionary():
    """A small CP dictionary laid out like the project's CP.pkl (event -> word, word -> event per type)."""
    e2w = {'Bar': {'Bar New': 0, 'Bar Continue': 1, 'Bar <PAD>': 2, 'Bar <MASK>': 3}}
    e2w['Position'] = {f'Position {i + 1}/16': i for i in range(16)}
    e2w['Position'].update({'Position <PAD>': 16, 'Position <MASK>': 17})
    e2w['Pitch'] = {f'Pitch {p}': i for i, p in enumerate(range(22, 108))}
    e2w['Pitch'].update({'Pitch <PAD>': 86, 'Pitch <MASK>': 87})
    e2w['Duration'] = {f'Duration {i}': i for i in range(16)}
    e2w['Duration'].update({'Duration <PAD>': 16, 'Duration <MASK>': 17})
    w2e = {k: {v: e for e, v in d.items()} for k, d in e2w.items()}
    return e2w, w2e


def random_piece(n_notes, rng):
    words = []
    for t in range(n_notes):
        bar = 0 if t % 6 == 0 else 1
        words.append([bar, rng.randrange(16), rng.randrange(86), rng.randrange(16)])
    labels = [rng.choice([1, 2, 3]) for _ in range(n_notes)]
    return np.array(words, dtype=np.int64), np.array(labels, dtype=np.int64)


def main():
    torch.manual_seed(0)
    rng = random.Random(0)
    e2w, w2e = make_dictionary()
    max_seq_len, layer, class_num = 32, 1, 4

    configuration = BertConfig(max_position_embeddings=max_seq_len, position_embedding_type='relative_key_query',
                               hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                               vocab_size=1)
    midibert = MidiBert(bertConfig=configuration, e2w=e2w, w2e=w2e)
    model = TokenClassification(midibert, class_num, configuration.hidden_size).eval()
    trainer = FinetuneTrainer(model, layer)

    lengths = [20, 7, 32, 13, 3, 26]
    pieces = [random_piece(n, rng) for n in lengths]

    # the dataset as the project's prepare_data writes it: pad words to max_seq_len, labels padded with 0
    X = np.tile(midibert.pad_word_np, (len(pieces), max_seq_len, 1))
    Y = np.zeros((len(pieces), max_seq_len), dtype=np.int64)
    for b, (words, labels) in enumerate(pieces):
        X[b, :len(words)] = words
        Y[b, :len(labels)] = labels
    X, Y = torch.from_numpy(X), torch.from_numpy(Y)
    loader = [(X[0:4], Y[0:4]), (X[4:], Y[4:])]

    with torch.no_grad():
        loss, acc, all_y_hat = trainer.iteration(loader)
        y_hat = torch.cat(all_y_hat)
        hidden = midibert(X, (Y != 0).float(), output_hidden_states=True).hidden_states

        batch_losses = [[], []]
        n_right, n_real = 0, 0
        for b, (words, labels) in enumerate(pieces):
            L = len(words)
            x1 = torch.from_numpy(words)[None]
            ref = midibert(x1, torch.ones(1, L), output_hidden_states=True).hidden_states
            assert torch.allclose(hidden[layer][b, :L], ref[layer][0], atol=1e-5), b
            assert torch.allclose(hidden[-1][b, :L], ref[-1][0], atol=1e-5), b
            ref_logits = model.classifier(ref[layer][0])
            assert torch.allclose(y_hat[b, :L], ref_logits, atol=1e-5), b
            logp = torch.log_softmax(ref_logits, -1)
            for t in range(L):  # double loop: piece x real note
                batch_losses[0 if b < 4 else 1].append(-logp[t, labels[t]])
                n_right += int(ref_logits[t].argmax().item() == labels[t])
                n_real += 1
        ref_loss = sum(torch.stack(l).mean().item() for l in batch_losses) / len(loader)
        assert abs(loss - ref_loss) < 1e-5, (loss, ref_loss)
        assert abs(acc - n_right / n_real) < 1e-9, (acc, n_right / n_real)
    print(f"melody extraction: {n_real} real notes in {len(pieces)} padded pieces; loss {loss:.4f}, "
          f"acc {acc:.3f} equal the per-piece runs")
    print("OK")


if __name__ == "__main__":
    main()
