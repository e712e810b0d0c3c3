# Correct program (quiet batch quiet-r159a).
# Ported from jiaweizzhao/GaLore @2cc66f88cce189e505affbb91042a8e77f5bf4e9 (torchrun_main.py last changed in
# 1b36c33782bdd74a4d6a4f51bc626ef67f51011f): torchrun_main.py (main's preprocess_batched, the TRAINING LOOP,
# evaluate_model), peft_pretraining/dataloader.py (PreprocessedIterableDataset), peft_pretraining/training_utils.py
# (collate_fn, batch_fn, get_scheculer / the cyclical cosine lambda), configs/llama_60m.json (its fields, tiny sizes).
# GaLore pretrains a LLaMA from its config (random weights; here the --use_hf_model path,
# AutoModelForCausalLM.from_config) on C4 with the T5 tokenizer: every document is tokenized on its own with
# truncation=True, padding="max_length" (right padding with <pad> = 0, "</s>" = 1 appended), the batch's
# attention_mask goes to the model as the tokenizer made it, and the labels are input_ids with every pad id set to
# -100, so the model's shifted mean cross-entropy counts only the real next tokens (the "</s>" included). The loop
# divides each micro-batch's loss by gradient_accumulation, steps the optimizer every gradient_accumulation batches
# and counts tokens_seen as the non-pad ids; evaluate_model averages the batch losses and counts the non-pad ids.
# Trimmed: one process (world_size 1, no DDP / all_gather / wandb / checkpoints), the "sgd" optimizer (momentum
# beta1) for a deterministic check, a word-level stand-in for t5-base with T5's special-token layout built offline
# with `tokenizers`, small in-memory lists in place of the streamed allenai/c4 splits. evaluate_model divides by the
# number of batches (upstream starts its counter at 1, one more than the batches it ran).
# Self-check: every logged micro-batch loss, tokens_seen, each evaluation's loss and token count, and every
# parameter after the run equal a reference written by hand: a float64 LLaMA forward (RMSNorm, rotate-half RoPE,
# a per-query loop over the keys at or before it, softmax by hand, SiLU MLP) run on each document alone with no padding, its loss
# summed token by token, trained with hand-written SGD-with-momentum at the same scheduled learning rates.
import json
import math
import os
import random
import tempfile
from functools import partial
from types import SimpleNamespace

import torch
import torch.utils.data
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import IterableDataset, get_worker_info
import itertools

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # tiny tensors: one thread is fastest on a shared CPU


# ---------------------------------------------------------------- peft_pretraining/dataloader.py
class PreprocessedIterableDataset(IterableDataset):
    def __init__(self, data, tokenizer, batch_size, max_length):
        super().__init__()
        self.data = data
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length

    def __iter__(self):
        worker_info = get_worker_info()
        if worker_info is None:
            # If no worker_info is provided, we are not using DataLoader workers, so yield all data
            iter_data = iter(self.data)
        else:
            # If using DataLoader workers, yield a subset of the data for this worker
            worker_id = worker_info.id
            num_workers = worker_info.num_workers
            iter_data = itertools.islice(self.data, worker_id, None, num_workers)

        batch = []
        for example in iter_data:
            tokenized_example = self.tokenizer(
                example["text"],
                max_length=self.max_length,
                truncation=True,
                padding="max_length",
                return_tensors="pt",
            )
            batch.append(tokenized_example)

            if len(batch) == self.batch_size:
                yield self._format_batch(batch)
                batch = []

        if batch:
            yield self._format_batch(batch)

    def _format_batch(self, batch):
        input_ids = torch.stack([item["input_ids"].squeeze(0) for item in batch])
        attention_mask = torch.stack([item["attention_mask"].squeeze(0) for item in batch])

        return {"input_ids": input_ids, "attention_mask": attention_mask}


# ---------------------------------------------------------------- peft_pretraining/training_utils.py
def get_scheculer(optimizer, *, scheduler_type, num_training_steps, warmup_steps, min_lr_ratio, cycle_length=None,
                  last_epoch=-1):
    if scheduler_type == "cosine":
        return get_cyclical_cosine_schedule_with_min_lr(
            optimizer,
            num_warmup_steps=warmup_steps,
            num_training_steps=num_training_steps,
            cycle_length=cycle_length,
            min_lr_ratio=min_lr_ratio,
            last_epoch=last_epoch,
        )
    raise NotImplementedError(f"Scheduler {scheduler_type} is not implemented")


def get_cyclical_cosine_schedule_with_min_lr(optimizer, num_warmup_steps, num_training_steps, cycle_length,
                                             min_lr_ratio=0.1, last_epoch=-1):
    assert cycle_length is not None or num_training_steps is not None
    if cycle_length is None:
        cycle_length = num_training_steps
    if num_training_steps % cycle_length != 0:
        raise ValueError(f"num_training_steps ({num_training_steps}) must be divisible by cycle_length ({cycle_length})")
    lr_lambda = partial(
        _get_cyclical_cosine_schedule_with_min_lr_lambda,
        num_warmup_steps=num_warmup_steps,
        cycle_length=cycle_length,
        min_lr_ratio=min_lr_ratio,
    )
    return LambdaLR(optimizer, lr_lambda, last_epoch)


def _get_cyclical_cosine_schedule_with_min_lr_lambda(current_step, *, num_warmup_steps, cycle_length, min_lr_ratio):
    assert 0 < min_lr_ratio <= 1.0, "min_lr_ratio must be in (0,1]"
    cycle_step = current_step % cycle_length
    if cycle_step < num_warmup_steps:
        if current_step != cycle_step:
            if cycle_step < 2:
                return 1e-7
        return float(cycle_step) / float(max(1, num_warmup_steps))
    progress = float(cycle_step - num_warmup_steps) / float(max(1, cycle_length - num_warmup_steps))
    cosine_decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine_decay


def collate_fn(batch_list):
    batch = {
        "input_ids": torch.stack([torch.Tensor(example["input_ids"]).long() for example in batch_list]),
        "attention_mask": torch.stack([torch.Tensor(example["attention_mask"]).long() for example in batch_list]),
    }
    return batch


def batch_fn(dataset, batch_size):
    batch = []
    for example in dataset:
        batch.append(example)
        if len(batch) == batch_size:
            batch = collate_fn(batch)
            yield batch
            batch = []
    if len(batch) > 0:
        yield batch


# ---------------------------------------------------------------- stand-ins for t5-base and allenai/c4
WORDS = ("the a of to and in is was for on with as by at from that it this be are or have an which not "
         "city river market school garden music light winter morning road story house water people").split()


def make_t5_like_tokenizer(max_length):
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def make_c4_split(n, rng):
    docs = []
    for i in range(n):
        k = rng.randint(2, 17)
        text = " ".join(rng.choice(WORDS + ["zebra"]) for _ in range(k))  # "zebra" is out of vocabulary: <unk>
        docs.append({"text": text, "timestamp": f"2019-04-{i % 28 + 1:02d}", "url": f"https://example.org/{i}"})
    return docs


def map_batched(data, fn, remove_columns, map_batch_size=1000):
    # datasets' IterableDataset.map(fn, batched=True, remove_columns=...), one example at a time out of it
    for s in range(0, len(data), map_batch_size):
        chunk = data[s:s + map_batch_size]
        cols = {k: [ex[k] for ex in chunk] for k in chunk[0]}
        out = fn(cols)
        for k in remove_columns:
            out.pop(k, None)
        for j in range(len(chunk)):
            yield {k: v[j].tolist() for k, v in out.items()}


# ---------------------------------------------------------------- torchrun_main.py
@torch.no_grad()
def evaluate_model(model, preprocess_batched, pad_idx, global_rank, world_size, device, batch_size):
    val_data_mapped = list(map_batched(VAL_DATA, preprocess_batched, remove_columns=["text", "timestamp", "url"]))

    target_eval_tokens = 10_000_000
    evaluated_on_tokens = 0
    total_loss = torch.tensor(0.0).to(device)
    total_batches = 0

    for batch in batch_fn(val_data_mapped, batch_size=batch_size):
        if evaluated_on_tokens > target_eval_tokens:
            break
        total_batches += 1

        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["input_ids"].clone()
        labels[labels == pad_idx] = -100
        loss = model(**batch, labels=labels).loss
        total_loss += loss.detach()

        evaluated_on_tokens += (batch["input_ids"] != pad_idx).sum().item() * world_size

    total_loss = total_loss / total_batches
    total_loss = total_loss.item()
    return total_loss, evaluated_on_tokens


LLAMA_CONFIG = {  # configs/llama_60m.json's fields, tiny sizes
    "architectures": ["LLaMAForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 88,
    "initializer_range": 0.02,
    "max_sequence_length": 1024,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "pad_token_id": -1,
    "rms_norm_eps": 1e-06,
    "transformers_version": "4.28.1",
    "use_cache": True,
    "vocab_size": 64,
}

rng = random.Random(0)
TRAIN_DATA = make_c4_split(28, rng)
VAL_DATA = make_c4_split(8, rng)


def main(args):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    global_rank, world_size = 0, 1
    device = "cpu"

    if args.total_batch_size is not None:
        if args.gradient_accumulation is None:
            args.gradient_accumulation = args.total_batch_size // (args.batch_size * world_size)
    assert args.gradient_accumulation * args.batch_size * world_size == args.total_batch_size

    data = TRAIN_DATA
    tokenizer = make_t5_like_tokenizer(args.max_length)

    def preprocess_batched(batch):
        batch = tokenizer(
            batch["text"],
            max_length=args.max_length,
            truncation=True,
            padding="max_length",
            return_tensors="pt",
        )
        return batch

    dataset = PreprocessedIterableDataset(data, tokenizer, batch_size=args.batch_size, max_length=args.max_length)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers)

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "llama_tiny.json"), "w") as f:
            json.dump(LLAMA_CONFIG, f)
        model_config = AutoConfig.from_pretrained(os.path.join(d, "llama_tiny.json"))
    model = AutoModelForCausalLM.from_config(model_config)
    model = model.to(device=device)
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    global_step = 0
    update_step = 0
    tokens_seen = 0
    tokens_seen_before = 0
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable_params, lr=args.lr, weight_decay=args.weight_decay, momentum=args.beta1)
    scheduler = get_scheculer(
        optimizer=optimizer,
        scheduler_type=args.scheduler,
        num_training_steps=args.num_training_steps,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
    )

    pad_idx = tokenizer.pad_token_id
    log = {"loss": [], "tokens_seen": [], "eval": []}

    for batch_idx, batch in enumerate(dataloader):

        global_step += 1

        if update_step > args.num_training_steps:
            break

        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["input_ids"].clone()
        labels[labels == pad_idx] = -100
        tokens_seen += (batch["input_ids"] != pad_idx).sum().item() * world_size

        loss = model(**batch, labels=labels).loss
        scaled_loss = loss / args.gradient_accumulation
        scaled_loss.backward()
        log["loss"].append(loss.item())

        if global_step % args.gradient_accumulation != 0:
            continue

        if args.grad_clipping != 0.0:
            torch.nn.utils.clip_grad_norm_(trainable_params, args.grad_clipping)

        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

        update_step += 1

        if update_step % args.eval_every == 0:
            total_loss, evaluated_on_tokens = evaluate_model(
                model, preprocess_batched, pad_idx, global_rank, world_size, device, args.batch_size
            )
            log["eval"].append((total_loss, evaluated_on_tokens))

        tokens_in_update = tokens_seen - tokens_seen_before
        tokens_seen_before = tokens_seen
        log["tokens_seen"].append(tokens_seen)

    model.eval()
    total_loss, evaluated_on_tokens = evaluate_model(
        model, preprocess_batched, pad_idx, global_rank, world_size, device, args.batch_size
    )
    log["eval"].append((total_loss, evaluated_on_tokens))
    return model, tokenizer, initial_state, log


# ---------------------------------------------------------------- reference written by hand
def ref_llama_logits(P, ids, cfg):
    """float64 LLaMA forward over one unpadded document; P maps state-dict names to tensors."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = H // nh
    eps = cfg["rms_norm_eps"]
    n = len(ids)

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    inv = [1.0 / (10000.0 ** (2 * i / hd)) for i in range(hd // 2)]
    cos = torch.tensor([[math.cos(t * f) for f in inv] * 2 for t in range(n)], dtype=torch.float64)
    sin = torch.tensor([[math.sin(t * f) for f in inv] * 2 for t in range(n)], dtype=torch.float64)

    def rope(x):  # x: (n, hd)
        rot = torch.cat([-x[:, hd // 2:], x[:, :hd // 2]], dim=-1)
        return x * cos + rot * sin

    x = P["model.embed_tokens.weight"][torch.tensor(ids)]
    for li in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{li}."
        h = rms(x, P[pre + "input_layernorm.weight"])
        q = h @ P[pre + "self_attn.q_proj.weight"].T
        k = h @ P[pre + "self_attn.k_proj.weight"].T
        v = h @ P[pre + "self_attn.v_proj.weight"].T
        heads = []
        for hh in range(nh):
            sl = slice(hh * hd, (hh + 1) * hd)
            qh, kh, vh = rope(q[:, sl]), rope(k[:, sl]), v[:, sl]
            rows = []
            for i in range(n):  # query i sees keys 0..i of its own document
                s = (kh[: i + 1] @ qh[i]) / math.sqrt(hd)
                w = torch.exp(s - s.max())
                rows.append((w / w.sum()) @ vh[: i + 1])
            heads.append(torch.stack(rows))
        x = x + torch.cat(heads, dim=-1) @ P[pre + "self_attn.o_proj.weight"].T
        h = rms(x, P[pre + "post_attention_layernorm.weight"])
        g = h @ P[pre + "mlp.gate_proj.weight"].T
        u = h @ P[pre + "mlp.up_proj.weight"].T
        x = x + (g * torch.sigmoid(g) * u) @ P[pre + "mlp.down_proj.weight"].T
    x = rms(x, P["model.norm.weight"])
    return x @ P["lm_head.weight"].T


def ref_doc_nll_sum(P, ids, cfg):
    logits = ref_llama_logits(P, ids, cfg)
    total = 0.0
    for t in range(len(ids) - 1):
        row = logits[t]
        total = total + (torch.logsumexp(row, dim=0) - row[ids[t + 1]])
    return total, len(ids) - 1


def ref_ids(text, max_length, vocab):
    ids = [vocab.get(w, 2) for w in text.split()][: max_length - 1] + [1]
    return ids


def ref_batch_loss(P, docs, cfg, max_length, vocab):
    tot, cnt = 0.0, 0
    for d in docs:
        s, c = ref_doc_nll_sum(P, ref_ids(d["text"], max_length, vocab), cfg)
        tot, cnt = tot + s, cnt + c
    return tot / cnt


def ref_lr_factor(step, warmup, total, min_ratio):
    if step < warmup:
        return step / warmup
    progress = (step - warmup) / (total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def reference(args, initial_state, vocab):
    cfg = LLAMA_CONFIG
    P = {k: v.detach().to(torch.float64).clone().requires_grad_(True) for k, v in initial_state.items()}
    names = list(P)
    mom = {k: None for k in names}
    mb = [TRAIN_DATA[i:i + args.batch_size] for i in range(0, len(TRAIN_DATA), args.batch_size)]
    out = {"loss": [], "tokens_seen": [], "eval": []}
    grads = {k: torch.zeros_like(P[k]) for k in names}
    seen, update = 0, 0

    def ref_eval():
        with torch.no_grad():
            vb = [VAL_DATA[i:i + args.batch_size] for i in range(0, len(VAL_DATA), args.batch_size)]
            losses = [ref_batch_loss(P, b, cfg, args.max_length, vocab).item() for b in vb]
            ntok = sum(len(ref_ids(d["text"], args.max_length, vocab)) for d in VAL_DATA)
        return sum(losses) / len(losses), ntok

    for step, docs in enumerate(mb, start=1):
        if update > args.num_training_steps:
            break
        seen += sum(len(ref_ids(d["text"], args.max_length, vocab)) for d in docs)
        loss = ref_batch_loss(P, docs, cfg, args.max_length, vocab)
        out["loss"].append(loss.item())
        g = torch.autograd.grad(loss / args.gradient_accumulation, [P[k] for k in names], allow_unused=True)
        for k, gk in zip(names, g):
            if gk is not None:
                grads[k] += gk
        if step % args.gradient_accumulation != 0:
            continue
        lr = args.lr * ref_lr_factor(update, args.warmup_steps, args.num_training_steps, args.min_lr_ratio)
        with torch.no_grad():
            for k in names:
                mom[k] = grads[k].clone() if mom[k] is None else args.beta1 * mom[k] + grads[k]
                P[k] -= lr * mom[k]
                grads[k].zero_()
        update += 1
        if update % args.eval_every == 0:
            out["eval"].append(ref_eval())
        out["tokens_seen"].append(seen)
    out["eval"].append(ref_eval())
    return P, out


if __name__ == "__main__":
    args = SimpleNamespace(
        batch_size=4, gradient_accumulation=None, total_batch_size=8, max_length=12, optimizer="sgd", lr=0.5,
        scheduler="cosine", min_lr_ratio=0.1, weight_decay=0.0, warmup_steps=1, eval_every=2,
        num_training_steps=4, grad_clipping=0.0, workers=0, seed=0, beta1=0.9, dtype="float32", single_gpu=True,
    )
    model, tokenizer, initial_state, log = main(args)

    vocab = tokenizer.get_vocab()
    P, ref = reference(args, initial_state, vocab)

    assert len(log["loss"]) == len(ref["loss"]) == 7, (len(log["loss"]), len(ref["loss"]))
    err_loss = max(abs(a - b) for a, b in zip(log["loss"], ref["loss"]))
    assert log["tokens_seen"] == ref["tokens_seen"], (log["tokens_seen"], ref["tokens_seen"])
    assert len(log["eval"]) == len(ref["eval"]) == 2
    err_eval = max(abs(a[0] - b[0]) for a, b in zip(log["eval"], ref["eval"]))
    assert [a[1] for a in log["eval"]] == [b[1] for b in ref["eval"]]
    sd = model.state_dict()
    err_param = max((sd[k].double() - P[k].detach()).abs().max().item() for k in P)
    moved = max((sd[k].double() - initial_state[k].double()).abs().max().item() for k in P)
    print(f"micro-batch losses {[round(x, 4) for x in log['loss']]}")
    print(f"tokens_seen {log['tokens_seen']}, evals {[(round(a, 4), b) for a, b in log['eval']]}")
    print(f"max |loss - ref| {err_loss:.2e}, |eval - ref| {err_eval:.2e}, |param - ref| {err_param:.2e} "
          f"(params moved by up to {moved:.2e})")
    assert err_loss < 1e-4 and err_eval < 1e-4 and err_param < 1e-5, (err_loss, err_eval, err_param)
    assert moved > 1e-3
    print("ok")
