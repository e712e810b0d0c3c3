# Correct program (quiet batch quiet-r135b).
# Ported from abhimishra91/transformers-tutorials transformers_summarization_wandb.ipynb
# @2ebdab079c7c91ff0d297a8b270c6efba95c1013 ("Fine Tuning Transformer for Summary Generation": CustomDataset,
# train(), validate(), main()). T5 is fine-tuned on news articles ("summarize: " + ctext -> text): source and
# summary are each tokenized with batch_encode_plus(max_length, pad_to_max_length=True) (T5 pads on the right with
# id 0); train() feeds `y[:, :-1]` as decoder_input_ids and `y[:, 1:]` as labels with the pad ids set to -100, the
# source's attention_mask going to the encoder (the decoder's pads sit after every real target token, behind the
# causal mask, and score nothing); validate() runs model.generate(input_ids, attention_mask, num_beams=2,
# repetition_penalty=2.5, length_penalty=1.0, early_stopping=True).
# Trimmed for CPU: a tiny T5 built from T5Config instead of t5-base, a word-level stand-in for T5Tokenizer, a list
# of rows instead of news_summary.csv, no wandb; `lm_labels=` is spelled `labels=` (its name since transformers 3),
# `pad_to_max_length=True` is `padding="max_length", truncation=True`, max lengths shrunk.
# Self-check: the batched teacher-forced loss and the logits at every scored position equal a per-example run on the
# unpadded article and summary with no masks; each article's beam-search summary (tokens and sequence score) from the
# padded validation batch equals the one generated for that article alone, unpadded, with no attention_mask.
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler
from transformers import T5Config, T5ForConditionalGeneration

device = "cpu"


class WordTokenizer:
    """Stands in for T5Tokenizer: one id per word, </s> appended, padded on the right with <pad> (id 0)."""

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, texts):
        self.vocab = {"<pad>": 0, "</s>": 1}
        for text in texts:
            for word in text.split():
                self.vocab.setdefault(word, len(self.vocab))
        self.inv = {i: w for w, i in self.vocab.items()}

    def __len__(self):
        return len(self.vocab)

    def batch_encode_plus(self, texts, max_length, padding="max_length", truncation=True, return_tensors="pt"):
        ids, masks = [], []
        for text in texts:
            row = [self.vocab[w] for w in text.split()][: max_length - 1] + [self.eos_token_id]
            n = len(row)
            ids.append(row + [self.pad_token_id] * (max_length - n))
            masks.append([1] * n + [0] * (max_length - n))
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(masks)}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in (self.pad_token_id, self.eos_token_id)]
        return " ".join(self.inv[i] for i in ids)


class Frame:
    """The two columns of news_summary.csv the notebook keeps."""

    def __init__(self, rows):
        self.text = [r[0] for r in rows]
        self.ctext = [r[1] for r in rows]


class CustomDataset(Dataset):

    def __init__(self, dataframe, tokenizer, source_len, summ_len):
        self.tokenizer = tokenizer
        self.data = dataframe
        self.source_len = source_len
        self.summ_len = summ_len
        self.text = self.data.text
        self.ctext = self.data.ctext

    def __len__(self):
        return len(self.text)

    def __getitem__(self, index):
        ctext = str(self.ctext[index])
        ctext = ' '.join(ctext.split())

        text = str(self.text[index])
        text = ' '.join(text.split())

        source = self.tokenizer.batch_encode_plus([ctext], max_length=self.source_len, padding="max_length",
                                                  truncation=True, return_tensors='pt')
        target = self.tokenizer.batch_encode_plus([text], max_length=self.summ_len, padding="max_length",
                                                  truncation=True, return_tensors='pt')

        source_ids = source['input_ids'].squeeze()
        source_mask = source['attention_mask'].squeeze()
        target_ids = target['input_ids'].squeeze()
        target_mask = target['attention_mask'].squeeze()

        return {
            'source_ids': source_ids.to(dtype=torch.long),
            'source_mask': source_mask.to(dtype=torch.long),
            'target_ids': target_ids.to(dtype=torch.long),
            'target_ids_y': target_ids.to(dtype=torch.long)
        }


def train(epoch, tokenizer, model, device, loader, optimizer):
    model.train()
    for _, data in enumerate(loader, 0):
        y = data['target_ids'].to(device, dtype=torch.long)
        y_ids = y[:, :-1].contiguous()
        lm_labels = y[:, 1:].clone().detach()
        lm_labels[y[:, 1:] == tokenizer.pad_token_id] = -100
        ids = data['source_ids'].to(device, dtype=torch.long)
        mask = data['source_mask'].to(device, dtype=torch.long)

        outputs = model(input_ids=ids, attention_mask=mask, decoder_input_ids=y_ids, labels=lm_labels)
        loss = outputs[0]

        if _ % 2 == 0:
            print(f'Epoch: {epoch}, Loss:  {loss.item()}')

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def validate(epoch, tokenizer, model, device, loader, max_length=12):
    model.eval()
    predictions = []
    actuals = []
    generated = []
    with torch.no_grad():
        for _, data in enumerate(loader, 0):
            y = data['target_ids'].to(device, dtype=torch.long)
            ids = data['source_ids'].to(device, dtype=torch.long)
            mask = data['source_mask'].to(device, dtype=torch.long)

            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_length=max_length,
                num_beams=2,
                repetition_penalty=2.5,
                length_penalty=1.0,
                early_stopping=True,
                return_dict_in_generate=True,
                output_scores=True,
            )
            generated_ids = out.sequences
            preds = [tokenizer.decode(g, skip_special_tokens=True, clean_up_tokenization_spaces=True)
                     for g in generated_ids]
            target = [tokenizer.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=True) for t in y]
            generated.extend(zip(ids, mask, generated_ids, out.sequences_scores))

            predictions.extend(preds)
            actuals.extend(target)
    return predictions, actuals, generated


ROWS = [
    ("rain floods city roads", "summarize: heavy rain on monday flooded several roads in the city and the "
     "traffic police closed two bridges for the evening"),
    ("team wins cup final", "summarize: the home team won the cup final after a late goal"),
    ("minister opens new hospital", "summarize: the health minister opened a new hospital with three hundred "
     "beds in the north of the state on friday"),
    ("prices of onions rise", "summarize: onion prices rose again this week"),
    ("court delays verdict in case", "summarize: the high court delayed its verdict in the land case to next "
     "month after the lawyers asked for more time"),
    ("school exams moved", "summarize: state board moved the school exams by a week"),
    ("airline adds new routes", "summarize: a budget airline said it will add four new routes from the city "
     "airport in the winter schedule"),
    ("farmers protest water cut", "summarize: farmers protested the water cut outside the district office"),
]


def main():
    torch.manual_seed(42)

    TRAIN_BATCH_SIZE = 2
    VALID_BATCH_SIZE = 4
    TRAIN_EPOCHS = 3
    LEARNING_RATE = 1e-3
    MAX_LEN = 24
    SUMMARY_LEN = 6

    tokenizer = WordTokenizer([t for r in ROWS for t in r])

    train_dataset = Frame(ROWS[:6])
    val_dataset = Frame(ROWS[6:] + ROWS[:2])
    training_set = CustomDataset(train_dataset, tokenizer, MAX_LEN, SUMMARY_LEN)
    val_set = CustomDataset(val_dataset, tokenizer, MAX_LEN, SUMMARY_LEN)

    training_loader = DataLoader(training_set, batch_size=TRAIN_BATCH_SIZE, sampler=RandomSampler(training_set))
    val_loader = DataLoader(val_set, batch_size=VALID_BATCH_SIZE, sampler=SequentialSampler(val_set))

    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      dropout_rate=0.1, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).to(device)

    optimizer = torch.optim.Adam(params=model.parameters(), lr=LEARNING_RATE)

    for epoch in range(TRAIN_EPOCHS):
        train(epoch, tokenizer, model, device, training_loader, optimizer)

    # Teacher forcing, as train() feeds it, against each pair run alone and unpadded.
    model.eval()
    data = next(iter(DataLoader(training_set, batch_size=len(training_set))))
    y = data['target_ids']
    y_ids = y[:, :-1].contiguous()
    lm_labels = y[:, 1:].clone().detach()
    lm_labels[y[:, 1:] == tokenizer.pad_token_id] = -100
    ids, mask = data['source_ids'], data['source_mask']
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, decoder_input_ids=y_ids, labels=lm_labels)
        total, count = 0.0, 0
        for i in range(len(ids)):
            m = int(mask[i].sum())
            n = int((y[i] != tokenizer.pad_token_id).sum())
            alone = model(input_ids=ids[i, :m][None], decoder_input_ids=y[i, :n - 1][None], labels=y[i, 1:n][None])
            err = (batched.logits[i, :n - 1] - alone.logits[0]).abs().max().item()
            assert err < 1e-4, (i, err)
            total += alone.loss.item() * (n - 1)
            count += n - 1
    assert abs(batched.loss.item() - total / count) < 1e-5, (batched.loss.item(), total / count)
    print(f"teacher forcing: batched loss {batched.loss.item():.5f} == per-pair {total / count:.5f}")

    # Beam-search validation on the padded batch, against each article summarized alone.
    predictions, actuals, generated = validate(TRAIN_EPOCHS, tokenizer, model, device, val_loader)
    with torch.no_grad():
        for k, (src, src_mask, seq, score) in enumerate(generated):
            m = int(src_mask.sum())
            ref = model.generate(input_ids=src[:m][None], max_length=12, num_beams=2, repetition_penalty=2.5,
                                 length_penalty=1.0, early_stopping=True, return_dict_in_generate=True,
                                 output_scores=True)
            ref_seq = ref.sequences[0]
            assert torch.equal(seq[:len(ref_seq)], ref_seq), (k, seq.tolist(), ref_seq.tolist())
            # generate fills a finished row out to the batch's longest with pad (or eos) ids
            tail = seq[len(ref_seq):]
            assert ((tail == tokenizer.pad_token_id) | (tail == tokenizer.eos_token_id)).all(), (k, seq.tolist())
            assert abs(score.item() - ref.sequences_scores[0].item()) < 1e-4, (k, score.item())
            print(f"  {actuals[k]!r:34} -> {predictions[k]!r}")
    print(f"beam search: {len(generated)} padded-batch summaries equal the unpadded single-article runs")


if __name__ == '__main__':
    main()
