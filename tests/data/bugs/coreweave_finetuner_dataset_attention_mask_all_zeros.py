# coreweave/kubernetes-cloud#146 ("Fix finetuner attention masking"): the finetuner's TokenizedDataset returned
# torch.zeros(context_length) as the attention mask of every context ("ignore all tokens"), which the model honoured
# once transformers respected the mask; the fix masks out only the padding tokens.
import io
import struct
import sys
import torch
from torch.utils.data import Dataset
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_TOKEN_ID = 0
CONTEXT = 12


class TokenizedDataset(Dataset):
    """
    Consumes a flat binary file containing 16-bit token serialization, aligned
    along `context_length` chunks.
    """

    def __init__(self, file, size, context_length=2048, pad_token_id=0):
        self.file = file
        self.length = int(size / 2 / context_length)
        self.formatstr = "%sH" % context_length
        self.context_length = context_length
        self.pad_token_id = pad_token_id

    def __len__(self):
        return self.length

    def load(self, idx):
        self.seek(idx)
        input_ids = torch.tensor(struct.unpack(self.formatstr, self.file.read(self.context_length * 2)))
        if FIXED:
            mask = (input_ids != self.pad_token_id).long()
        else:
            mask = torch.zeros(self.context_length)
        return input_ids, mask

    def seek(self, idx):
        self.file.seek(self.context_length * idx * 2)

    def __getitem__(self, idx):
        return self.load(idx)


# two contexts, the second one padded at the end (as the tokenizer step writes them)
ctx0 = [5, 9, 13, 7, 22, 31, 8, 17, 40, 3, 11, 6]
ctx1 = [14, 25, 9, 33, 2, 19, 7, PAD_TOKEN_ID, PAD_TOKEN_ID, PAD_TOKEN_ID, PAD_TOKEN_ID, PAD_TOKEN_ID]
raw = struct.pack("%sH" % (2 * CONTEXT), *(ctx0 + ctx1))
dataset = TokenizedDataset(io.BytesIO(raw), len(raw), context_length=CONTEXT, pad_token_id=PAD_TOKEN_ID)

collector = lambda data: {
    "input_ids": torch.stack([f[0] for f in data]),
    "attention_mask": torch.stack([f[1] for f in data]),
    "labels": torch.stack([f[0] for f in data]),
}

config = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64, rotary_pct=0.25,
                       pad_token_id=PAD_TOKEN_ID, use_cache=False)
config._attn_implementation = "eager"
model = GPTNeoXForCausalLM(config)

inputs = collector([dataset[0], dataset[1]])
inputs["labels"][inputs["labels"] == PAD_TOKEN_ID] = -100  # ModifiedTrainer.compute_loss
model.train()
outputs = model(**inputs)  # the Trainer's training step
outputs["loss"].backward()

model.eval()
with torch.no_grad():
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    ref = model(input_ids=inputs["input_ids"][:1]).logits  # context 0, plain causal
print("mode:", "fixed" if FIXED else "buggy", "loss %.4f" % outputs["loss"].item())
print("context 0 logits vs plain causal run, max abs diff: %.5f" % (logits[0] - ref[0]).abs().max().item())
