# IcarusWizard/MAE#17, fixed by commit 11c21fc ("Fix a bug that pointed out by @Hong753 in #17"), model.py
# MAE_Decoder.forward. The encoder returns 1 + remain_T features (the cls token first, then the visible patches in
# shuffled order). The decoder drops the cls slot (`features = features[1:]`) before the head, so in the shuffled
# order the visible patches are rows 0 .. T-2 and the masked patches rows T-1 .. end; but the reconstruction mask
# was built with `mask[T:] = 1`, T counted with the cls token, so one masked patch per image (shuffled row T-1) is
# marked visible: it drops out of the MAE loss `mean((pred - img) ** 2 * mask) / mask_ratio` and is pasted back
# from the input in the visualisation. Fix: `mask[T-1:] = 1`.
# (model.py and mae_pretrain.py's loss step as the repository wrote them, CIFAR-10 shapes shrunk; timm's Block
# written out as timm 0.9 lays it; einops' repeat / rearrange written with torch.)
import sys

import numpy as np
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def trunc_normal_(tensor, std=1.0):
    return torch.nn.init.trunc_normal_(tensor, std=std, a=-2.0, b=2.0)


class Mlp(torch.nn.Module):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden_features)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Attention(torch.nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = torch.nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Block(torch.nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


def random_indexes(size: int):
    forward_indexes = np.arange(size)
    np.random.shuffle(forward_indexes)
    backward_indexes = np.argsort(forward_indexes)
    return forward_indexes, backward_indexes


def take_indexes(sequences, indexes):
    # repeat(indexes, 't b -> t b c', c=sequences.shape[-1])
    return torch.gather(sequences, 0, indexes.unsqueeze(-1).expand(-1, -1, sequences.shape[-1]))


def patch2img(x, patch_size, h):
    # Rearrange('(h w) b (c p1 p2) -> b c (h p1) (w p2)', p1=patch_size, p2=patch_size, h=h)
    T, B, D = x.shape
    w = T // h
    c = D // (patch_size * patch_size)
    x = x.reshape(h, w, B, c, patch_size, patch_size)
    x = x.permute(2, 3, 0, 4, 1, 5)
    return x.reshape(B, c, h * patch_size, w * patch_size)


class PatchShuffle(torch.nn.Module):
    def __init__(self, ratio) -> None:
        super().__init__()
        self.ratio = ratio

    def forward(self, patches: torch.Tensor):
        T, B, C = patches.shape
        remain_T = int(T * (1 - self.ratio))

        indexes = [random_indexes(T) for _ in range(B)]
        forward_indexes = torch.as_tensor(np.stack([i[0] for i in indexes], axis=-1), dtype=torch.long).to(patches.device)
        backward_indexes = torch.as_tensor(np.stack([i[1] for i in indexes], axis=-1), dtype=torch.long).to(patches.device)

        patches = take_indexes(patches, forward_indexes)
        patches = patches[:remain_T]

        return patches, forward_indexes, backward_indexes


class MAE_Encoder(torch.nn.Module):
    def __init__(self, image_size=32, patch_size=2, emb_dim=192, num_layer=12, num_head=3, mask_ratio=0.75) -> None:
        super().__init__()

        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, emb_dim))
        self.pos_embedding = torch.nn.Parameter(torch.zeros((image_size // patch_size) ** 2, 1, emb_dim))
        self.shuffle = PatchShuffle(mask_ratio)

        self.patchify = torch.nn.Conv2d(3, emb_dim, patch_size, patch_size)

        self.transformer = torch.nn.Sequential(*[Block(emb_dim, num_head) for _ in range(num_layer)])

        self.layer_norm = torch.nn.LayerNorm(emb_dim)

        self.init_weight()

    def init_weight(self):
        trunc_normal_(self.cls_token, std=.02)
        trunc_normal_(self.pos_embedding, std=.02)

    def forward(self, img):
        patches = self.patchify(img)
        patches = patches.flatten(2).permute(2, 0, 1)  # 'b c h w -> (h w) b c'
        patches = patches + self.pos_embedding

        patches, forward_indexes, backward_indexes = self.shuffle(patches)

        patches = torch.cat([self.cls_token.expand(-1, patches.shape[1], -1), patches], dim=0)
        patches = patches.transpose(0, 1)  # 't b c -> b t c'
        features = self.layer_norm(self.transformer(patches))
        features = features.transpose(0, 1)  # 'b t c -> t b c'

        return features, backward_indexes


class MAE_Decoder(torch.nn.Module):
    def __init__(self, image_size=32, patch_size=2, emb_dim=192, num_layer=4, num_head=3) -> None:
        super().__init__()

        self.mask_token = torch.nn.Parameter(torch.zeros(1, 1, emb_dim))
        self.pos_embedding = torch.nn.Parameter(torch.zeros((image_size // patch_size) ** 2 + 1, 1, emb_dim))

        self.transformer = torch.nn.Sequential(*[Block(emb_dim, num_head) for _ in range(num_layer)])

        self.head = torch.nn.Linear(emb_dim, 3 * patch_size ** 2)
        self.patch_size = patch_size
        self.grid_h = image_size // patch_size

        self.init_weight()

    def patch2img(self, x):
        return patch2img(x, self.patch_size, self.grid_h)

    def init_weight(self):
        trunc_normal_(self.mask_token, std=.02)
        trunc_normal_(self.pos_embedding, std=.02)

    def forward(self, features, backward_indexes):
        T = features.shape[0]
        backward_indexes = torch.cat([torch.zeros(1, backward_indexes.shape[1]).to(backward_indexes), backward_indexes + 1], dim=0)
        features = torch.cat([features, self.mask_token.expand(backward_indexes.shape[0] - features.shape[0], features.shape[1], -1)], dim=0)
        features = take_indexes(features, backward_indexes)
        features = features + self.pos_embedding

        features = features.transpose(0, 1)
        features = self.transformer(features)
        features = features.transpose(0, 1)
        features = features[1:]  # remove global feature

        patches = self.head(features)
        mask = torch.zeros_like(patches)
        if FIXED:
            mask[T - 1:] = 1
        else:
            mask[T:] = 1
        mask = take_indexes(mask, backward_indexes[1:] - 1)
        img = self.patch2img(patches)
        mask = self.patch2img(mask)

        return img, mask


class MAE_ViT(torch.nn.Module):
    def __init__(self, image_size=32, patch_size=2, emb_dim=192, encoder_layer=12, encoder_head=3,
                 decoder_layer=4, decoder_head=3, mask_ratio=0.75) -> None:
        super().__init__()

        self.encoder = MAE_Encoder(image_size, patch_size, emb_dim, encoder_layer, encoder_head, mask_ratio)
        self.decoder = MAE_Decoder(image_size, patch_size, emb_dim, decoder_layer, decoder_head)

    def forward(self, img):
        features, backward_indexes = self.encoder(img)
        predicted_img, mask = self.decoder(features, backward_indexes)
        return predicted_img, mask


def main():
    torch.manual_seed(42)
    np.random.seed(42)
    mask_ratio = 0.75
    model = MAE_ViT(image_size=8, patch_size=2, emb_dim=24, encoder_layer=2, encoder_head=3,
                    decoder_layer=1, decoder_head=3, mask_ratio=mask_ratio)
    optim = torch.optim.AdamW(model.parameters(), lr=1.5e-4 * 4 / 256, betas=(0.9, 0.95), weight_decay=0.05)

    img = torch.rand(4, 3, 8, 8) * 2 - 1  # ToTensor + Normalize(0.5, 0.5)
    model.train()
    predicted_img, mask = model(img)
    loss = torch.mean((predicted_img - img) ** 2 * mask) / mask_ratio
    loss.backward()
    optim.step()
    optim.zero_grad()
    print(f"mae loss {loss.item():.6f}, masked pixels per image {mask[:, 0].sum(dim=(1, 2)).tolist()}")

    model.eval()
    with torch.no_grad():
        predicted_val_img, mask = model(img)
        predicted_val_img = predicted_val_img * mask + img * (1 - mask)
        print(f"visualised reconstruction mean {predicted_val_img.mean().item():.6f}")


if __name__ == "__main__":
    main()
