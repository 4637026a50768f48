"""Parallel degrees: validation against the world size and the named device mesh."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_amp.config import ConfigError, ParallelismConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The meshes build_mesh derives from the root one (ParallelDims.get_mesh(name)), and what each is.
MESHES = {
    "dp": "all data-parallel ranks (replicate x shard) of this rank's pp/cp/tp coordinates, flattened",
    "fsdp": "FSDP's mesh: dp_shard x cp flattened, with dp_replicate in front under HSDP",
    "loss": "every rank holding a share of the step's tokens: data-parallel x context-parallel",
    "ep": "the ranks a layer's routed experts are split over (consecutive ranks of dp_shard x cp)",
    "expert": "the mesh the routed experts are DTensors on: ep (Shard(0)), then tp (Replicate) under TP",
    "expert_fsdp": "FSDP's mesh for the routed experts: efsdp, with dp_replicate in front under HSDP",
}
EXPERT_MESHES = ("ep", "expert", "expert_fsdp")  # built only with expert_parallel_degree > 1


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    ep: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    # The meshes build_mesh derives, by their names in MESHES (get_mesh reads them).
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, p: ParallelismConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard = -1 and check that the degrees multiply to the world size."""
        cp = p.context_parallel_degree
        rep, tp, pp = p.data_parallel_replicate_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree
        others = rep * tp * pp * cp
        dp_shard = p.data_parallel_shard_degree
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"replicate x tp x pp x cp = {rep} x {tp} x {pp} x {cp} = {others} does not "
                    f"divide the world size {world_size}"
                )
            dp_shard = world_size // others
        if others * dp_shard != world_size:
            raise ConfigError(
                f"replicate x shard x tp x pp x cp = {rep} x {dp_shard} x {tp} x {pp} x {cp} = "
                f"{others * dp_shard} differs from the world size {world_size}"
            )
        ep = p.expert_parallel_degree
        if (dp_shard * cp) % ep:
            raise ConfigError(
                f"'parallelism.expert_parallel_degree' = {ep} must divide data_parallel_shard_degree "
                f"x context_parallel_degree = {dp_shard} x {cp} = {dp_shard * cp} (EP borrows "
                f"its ranks from FSDP's)"
            )
        return cls(
            p.data_parallel_replicate_degree,
            dp_shard,
            p.tensor_parallel_degree,
            p.pipeline_parallel_degree,
            world_size,
            cp,
            ep,
        )

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards parameters over: dp_shard x cp (context-parallel ranks hold no
        replicated weights, as in torchtitan)."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        """Replicate-only data parallel (no sharding): the classic DDP path."""
        return self.dp_replicate > 1 and self.fsdp_shard == 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_mesh_dims(self) -> tuple[str, ...]:
        """The mesh dims FSDP shards over (after build_mesh, `get_mesh("fsdp")` is them as one mesh)."""
        return ("dp_replicate", "dp_shard_cp") if self.hsdp_enabled else ("dp_shard_cp",)

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Ranks FSDP shards the routed experts over (with dp_replicate under HSDP): what is left of
        dp_shard x cp once EP has taken its ranks."""
        return self.fsdp_shard // self.ep

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def dp_rank(self, rank: int) -> int:
        """This rank's index in the flattened dp dim, known before any process group: the mesh
        lays ranks out row-major over (pp, dp_replicate, dp_shard, cp, tp)."""
        return (rank // (self.tp * self.cp)) % self.dp_degree

    def cp_rank(self, rank: int) -> int:
        """This rank's index in the cp dim (which chunks of each sequence it holds)."""
        return (rank // self.tp) % self.cp

    def coordinates(self, world_size: int) -> dict[str, int]:
        """This rank's index along each mesh dim (all 0 in a single process: no mesh is built)."""
        if world_size == 1:
            return dict.fromkeys(MESH_DIMS, 0)
        coordinate = self.mesh.get_coordinate()
        assert coordinate is not None  # the mesh spans every rank of the world, this one included
        return dict(zip(MESH_DIMS, coordinate))

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One mesh with every dim named, plus flattened views: `dp` (the data loader's ranks),
        `dp_shard_cp` (FSDP's shards) and `dp_cp` (the ranks whose losses make the global mean)."""
        degrees = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        mesh = init_device_mesh(device_type, degrees, mesh_dim_names=MESH_DIMS)
        # Keep the flattened views: slicing them back out of the root mesh is deprecated in torch.
        meshes = {"dp": mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")}
        shard_cp = mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
        meshes["loss"] = mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
        meshes["fsdp"] = fsdp = mesh["dp_replicate", "dp_shard_cp"] if self.hsdp_enabled else shard_cp
        if self.ep_enabled:
            # EP takes the innermost (nearest) ranks of dp_shard x cp, as torchtitan; unflattened
            # from FSDP's dim so that both expert meshes share the root mesh, which FSDP needs to
            # shard parameters that are already DTensors on the ep mesh.
            # By index: torch 2.11's _unflatten does not find a dim given by name.
            sparse = fsdp._unflatten(fsdp.ndim - 1, (self.efsdp, self.ep), ("efsdp", "ep"))
            meshes["ep"] = sparse["ep"]
            meshes["expert_fsdp"] = sparse["dp_replicate", "efsdp"] if self.hsdp_enabled else sparse["efsdp"]
            # Under TP the experts are also replicated over tp (ETP = 1): one (ep, tp) mesh, whose ep
            # groups are the ranks of one tp coordinate.
            meshes["expert"] = DeviceMesh._concatenate([meshes["ep"], mesh["tp"]]) if self.tp_enabled else meshes["ep"]
        self._meshes = meshes
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """A mesh build_mesh derived from the root one, by its name in MESHES (the root mesh's own
        dims are `mesh[dim]`)."""
        if name not in MESHES:
            raise ValueError(
                f"unknown mesh {name!r}; allowed meshes: {', '.join(MESHES)} "
                "(the root mesh's dims: ParallelDims.mesh[name])"
            )
        if name not in self._meshes:
            needs = " with expert_parallel_degree > 1" if name in EXPERT_MESHES else ""
            raise RuntimeError(f"ParallelDims.build_mesh() has not been called{needs}")
        return self._meshes[name]
