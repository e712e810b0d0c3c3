# lucidrains/meshgpt-pytorch commit a7c0ccf ("fix a bug with is_neighbor_mask"): in
# derive_face_edges_from_faces, `n >= threshold & face_edge_mask` binds as `n >= (threshold & mask)`, so every
# face pair (padding included) became a neighbour edge, and encode() offset each mesh's edges by its own face count.
import sys
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- meshgpt_pytorch/data.py ----
def derive_face_edges_from_faces(faces, pad_id=-1, neighbor_if_share_one_vertex=False, include_self=True):
    is_one_face, device = faces.ndim == 2, faces.device
    if is_one_face:
        faces = faces[None]

    max_num_faces = faces.shape[1]
    face_edges_vertices_threshold = 1 if neighbor_if_share_one_vertex else 2

    all_edges = torch.stack(torch.meshgrid(
        torch.arange(max_num_faces, device=device),
        torch.arange(max_num_faces, device=device),
        indexing='ij'), dim=-1)

    face_masks = (faces != pad_id).all(dim=-1)                                   # reduce 'b nf c -> b nf' all
    face_edges_masks = face_masks[:, :, None] & face_masks[:, None, :]

    face_edges = []
    for face, face_edge_mask in zip(faces, face_edges_masks):
        shared_vertices = face[:, None, :, None] == face[None, :, None, :]      # 'i 1 c 1' == '1 j 1 c'
        num_shared_vertices = shared_vertices.any(dim=-1).sum(dim=-1)
        if FIXED:
            is_neighbor_face = (num_shared_vertices >= face_edges_vertices_threshold) & face_edge_mask
        else:
            is_neighbor_face = num_shared_vertices >= face_edges_vertices_threshold & face_edge_mask

        if not include_self:
            is_neighbor_face &= num_shared_vertices != 3

        face_edge = all_edges[is_neighbor_face]
        face_edges.append(face_edge)

    face_edges = pad_sequence(face_edges, padding_value=pad_id, batch_first=True)
    if is_one_face:
        face_edges = face_edges[0]
    return face_edges


# ---- MeshAutoencoder.forward -> encode(): the edge bookkeeping before the SAGEConv layers ----
def encoder_edge_index(faces, pad_id=-1):
    face_edges = derive_face_edges_from_faces(faces, pad_id=pad_id)
    face_mask = (faces != pad_id).all(dim=-1)
    face_edges_mask = (face_edges != pad_id).all(dim=-1)

    if FIXED:
        face_index_offsets = face_mask.long().sum(dim=-1)                        # reduce 'b nf -> b' sum
        face_index_offsets = F.pad(face_index_offsets.cumsum(dim=0), (1, -1), value=0)
        face_index_offsets = face_index_offsets[:, None, None]
    else:
        face_index_offsets = face_mask.long().sum(dim=-1)[:, None, None]         # reduce 'b nf -> b 1 1' sum
    face_edges = face_edges + face_index_offsets
    face_edges = face_edges[face_edges_mask]
    face_edges = face_edges.t()                                                  # 'be ij -> ij be'
    return face_edges, int(face_mask.sum())


# two small triangle strips, the second padded with pad_id rows (as custom_collate pads them)
def strip(n_faces):
    return torch.stack([torch.arange(n_faces), torch.arange(n_faces) + 1, torch.arange(n_faces) + 2], dim=-1)


meshes = [strip(7), strip(4)]
faces = pad_sequence(meshes, batch_first=True, padding_value=-1)

edge_index, num_real_faces = encoder_edge_index(faces)
got = set(map(tuple, edge_index.t().tolist()))

# reference: loop over each mesh, neighbours = faces sharing >= 2 vertices, indices into the packed face rows
ref, offset = set(), 0
for m in meshes:
    for i in range(len(m)):
        for j in range(len(m)):
            if len(set(m[i].tolist()) & set(m[j].tolist())) >= 2:
                ref.add((i + offset, j + offset))
    offset += len(m)

out_of_range = sum(1 for e in got if max(e) >= num_real_faces)
print(f"edges fed to SAGEConv: {len(got)}, expected {len(ref)}; wrong edges = {len(got ^ ref)}, "
      f"pointing past the {num_real_faces} packed faces = {out_of_range}")
print(f"wrong_edges={len(got ^ ref)}")
