"""Parallel degrees: validation against the world size and the named device mesh."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_amp.config import ConfigError, Parallelism

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _dp_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, p: Parallelism, world_size: int) -> "ParallelDims":
        """Resolve dp_shard = -1 and check that the degrees multiply to the world size."""
        others = p.data_parallel_replicate_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
        dp_shard = p.data_parallel_shard_degree
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"replicate x tp x pp = {p.data_parallel_replicate_degree} x "
                    f"{p.tensor_parallel_degree} x {p.pipeline_parallel_degree} = {others} "
                    f"does not divide the world size {world_size}"
                )
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ConfigError(
                f"replicate x shard x tp x pp = {p.data_parallel_replicate_degree} x {dp_shard} x "
                f"{p.tensor_parallel_degree} x {p.pipeline_parallel_degree} = {others * dp_shard} "
                f"differs from the world size {world_size}"
            )
        return cls(p.data_parallel_replicate_degree, dp_shard, p.tensor_parallel_degree,
                   p.pipeline_parallel_degree, world_size)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        """Replicate-only data parallel (no sharding): the classic DDP path."""
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def dp_rank(self, rank: int) -> int:
        """This rank's index in the flattened dp dim, known before any process group: the mesh
        lays ranks out row-major over (pp, dp_replicate, dp_shard, tp)."""
        return (rank // self.tp) % self.dp_degree

    def coordinates(self, world_size: int) -> dict[str, int]:
        """This rank's index along each mesh dim (all 0 in a single process: no mesh is built)."""
        if world_size == 1:
            return dict.fromkeys(MESH_DIMS, 0)
        return dict(zip(MESH_DIMS, self.mesh.get_coordinate()))

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One mesh with every dim named, plus the flattened `dp` view the data loader uses."""
        degrees = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        mesh = init_device_mesh(device_type, degrees, mesh_dim_names=MESH_DIMS)
        # Keep the flattened view: slicing "dp" back out of the root mesh is deprecated in torch.
        self._dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks (replicate x shard) of this rank's pp/tp coordinates, flattened."""
        if self._dp_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._dp_mesh
