"""SqueezeLLM: non-uniform quantization with a per-row lookup table, weighted by
sensitivity, plus a sparse full-precision part for the outliers (dense-and-sparse).

Each output channel (row) gets 2^bits centroids from a k-means over its weights in which a
weight counts by its Fisher information (the mean squared gradient of the loss on the
calibration data): the weights the loss is sensitive to are kept closest. Before
clustering, the largest-magnitude `outlier_fraction` of the layer's weights and then the
`sensitive_fraction` with the most Fisher information (the paper's 0.45 % and 0.05 %) are
set aside; they are stored exactly, as a sparse matrix of (weight - its centroid), so that
W = lookup_table[row, index] + sparse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ROWS_PER_CHUNK = 256  # torch.quantile takes at most 2^24 values


@dataclass(frozen=True)
class LutWeight:
    indices: torch.Tensor  # [out, in] int64 in [0, 2^bits)
    lookup_table: torch.Tensor  # [out, 2^bits] float32, float16-exact
    sparse_rows: torch.Tensor  # [out + 1] int64: CSR row pointers of the outliers
    sparse_cols: torch.Tensor  # [nnz] int64
    sparse_values: torch.Tensor  # [nnz] float32, float16-exact: weight - its centroid

    @property
    def shape(self) -> torch.Size:
        return self.indices.shape

    def check(self) -> None:
        """Raises ValueError unless the parts fit together, without building the weight."""
        out_features, in_features = self.indices.shape
        nnz = self.sparse_values.shape[0]
        if self.lookup_table.dim() != 2 or self.lookup_table.shape[0] != out_features:
            raise ValueError(f"lookup_table {list(self.lookup_table.shape)} must be "
                             f"[{out_features}, 2^bits]")
        if self.indices.numel() and int(self.indices.max()) >= self.lookup_table.shape[1]:
            raise ValueError(f"indices must be below {self.lookup_table.shape[1]}")
        pointers = self.sparse_rows.long()
        if (self.sparse_rows.shape != (out_features + 1,) or self.sparse_cols.shape != (nnz,)
                or int(pointers[0]) != 0 or int(pointers[-1]) != nnz
                or bool((pointers.diff() < 0).any())):
            raise ValueError(f"sparse_rows {list(self.sparse_rows.shape)} must be the CSR "
                             f"pointers of {out_features} rows over {nnz} sparse_values and "
                             f"sparse_cols {list(self.sparse_cols.shape)}")
        cols = self.sparse_cols
        if nnz and not 0 <= int(cols.min()) <= int(cols.max()) < in_features:
            raise ValueError(f"sparse_cols must be below {in_features}")

    def dequantize(self) -> torch.Tensor:
        return dequantize_lut(self.indices, self.lookup_table, self.sparse_rows,
                              self.sparse_cols, self.sparse_values)

    def sparse_matrix(self) -> torch.Tensor:
        """The outliers' part as a sparse COO tensor [out, in] of float32."""
        return torch.sparse_coo_tensor(
            torch.stack([_row_of(self.sparse_rows), self.sparse_cols.long()]),
            self.sparse_values.float(), tuple(self.indices.shape), is_coalesced=True,
            check_invariants=False)

    def input_slice(self, start: int, end: int) -> LutWeight:
        """The layer over input channels [start, end) only (a row-parallel rank's share)."""
        cols = self.sparse_cols.long()
        kept = (cols >= start) & (cols < end)
        pointers = torch.zeros_like(self.sparse_rows)
        pointers[1:] = torch.bincount(_row_of(self.sparse_rows)[kept],
                                      minlength=self.indices.shape[0]).cumsum(0)
        return LutWeight(self.indices[:, start:end].contiguous(), self.lookup_table, pointers,
                         self.sparse_cols[kept] - start, self.sparse_values[kept])

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LutWeight:
        """The layer with `fn`, a selection or reordering of output rows, applied to every
        part."""
        kept = fn(torch.arange(self.indices.shape[0]).unsqueeze(1))[:, 0]
        new_row = torch.full((self.indices.shape[0],), -1, dtype=torch.long)
        new_row[kept] = torch.arange(len(kept))
        rows = new_row[_row_of(self.sparse_rows)]
        order = torch.argsort(rows * self.indices.shape[1] + self.sparse_cols.long())
        order = order[rows[order] >= 0]
        pointers = torch.zeros(len(kept) + 1, dtype=self.sparse_rows.dtype)
        pointers[1:] = torch.bincount(rows[order], minlength=len(kept)).cumsum(0)
        return LutWeight(fn(self.indices), fn(self.lookup_table), pointers,
                         self.sparse_cols[order], self.sparse_values[order])


def dequantize_lut(indices: torch.Tensor, lookup_table: torch.Tensor, rows: torch.Tensor,
                   cols: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    dense = lookup_table.float().gather(1, indices.long())
    dense[_row_of(rows), cols.long()] += values.float()
    return dense


def _row_of(pointers: torch.Tensor) -> torch.Tensor:
    """Each stored value's row, from CSR row pointers."""
    counts = pointers.long().diff()
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


def squeezellm(weight: torch.Tensor, fisher: torch.Tensor, bits: int,
               outlier_fraction: float = 0.0045, sensitive_fraction: float = 0.0005,
               iterations: int = 25) -> LutWeight:
    """SqueezeLLM of weight [out, in], given the Fisher diagonal of the same shape. The sparse
    part keeps the `outlier_fraction` of largest magnitude and, beyond those, the
    `sensitive_fraction` with the largest Fisher information."""
    w = weight.float()
    outlier = torch.zeros_like(w, dtype=torch.bool)
    num_outliers = int(outlier_fraction * w.numel())
    if num_outliers:
        outlier.view(-1)[torch.topk(w.abs().flatten(), num_outliers).indices] = True
    num_sensitive = int(sensitive_fraction * w.numel())
    if num_sensitive:
        ranked = fisher.float().masked_fill(outlier, -1.0).flatten()
        outlier.view(-1)[torch.topk(ranked, num_sensitive).indices] = True
    # Every weight counts a little, so rows whose gradients vanished still cluster.
    sensitivity = (fisher.float() + 1e-12 * fisher.float().mean().clamp(min=1e-30))
    sensitivity = sensitivity.masked_fill(outlier, 0.0)
    tables, indices = [], []
    for start in range(0, w.shape[0], ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        table, index = _weighted_kmeans(w[rows], sensitivity[rows], 2**bits, iterations)
        tables.append(table)
        indices.append(index)
    table = torch.cat(tables).half().float()
    index = torch.cat(indices)
    rows, cols = outlier.nonzero(as_tuple=True)  # row-major, as CSR lists them
    pointers = torch.zeros(w.shape[0] + 1, dtype=torch.long)
    pointers[1:] = torch.bincount(rows, minlength=w.shape[0]).cumsum(0)
    values = (w[rows, cols] - table.gather(1, index)[rows, cols]).half().float()
    return LutWeight(index, table, pointers, cols, values)


def _weighted_kmeans(w: torch.Tensor, weight: torch.Tensor, k: int, iterations: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of w, k centroids minimizing the weighted squared error; starts from the
    row's quantiles. Returns the centroids [rows, k], ascending, and each value's centroid
    index."""
    levels = (torch.arange(k, dtype=torch.float32) + 0.5) / k
    centroids = torch.quantile(w, levels, dim=1).t().contiguous()
    for _ in range(iterations):
        index = _nearest(w, centroids)
        mass = torch.zeros_like(centroids).scatter_add_(1, index, weight)
        moment = torch.zeros_like(centroids).scatter_add_(1, index, weight * w)
        centroids = torch.where(mass > 0, moment / mass.clamp(min=1e-30), centroids)
        centroids = centroids.sort(dim=1).values
    return centroids, _nearest(w, centroids)


def _nearest(w: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Each value's nearest centroid of its row's ascending ones (the lower of two as near): a
    binary search among the midpoints, log2(k) steps a value where comparing with every
    centroid took k (8-bit tables: 8 against 256)."""
    midpoints = (centroids[:, 1:] + centroids[:, :-1]) / 2
    return torch.searchsorted(midpoints.contiguous(), w.contiguous())
