"""mpirun's variables become torch's env:// variables (cgx2.launch)."""

import pytest

from cgx2.launch import DEFAULT_PORT, setup_mpi_env

OMPI_ONE_NODE = {
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}


def test_open_mpi_on_one_node():
    env = dict(OMPI_ONE_NODE)
    assert setup_mpi_env(env)
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "4",
        "2",
        "2",
        "4",
    )
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert env["MASTER_PORT"] == str(DEFAULT_PORT)


def test_port_follows_the_job_and_is_the_same_on_every_rank():
    ports = set()
    for rank in range(4):
        env = {**OMPI_ONE_NODE, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_MCA_ess_base_jobid": "7"}
        setup_mpi_env(env)
        ports.add(env["MASTER_PORT"])
    other = {**OMPI_ONE_NODE, "OMPI_MCA_ess_base_jobid": "8"}
    setup_mpi_env(other)
    assert len(ports) == 1 and other["MASTER_PORT"] not in ports
    assert DEFAULT_PORT <= int(other["MASTER_PORT"]) < DEFAULT_PORT + 1000


def test_user_settings_win():
    env = {**OMPI_ONE_NODE, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "4040", "RANK": "2"}
    setup_mpi_env(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.1.2.3", "4040")


def test_several_nodes_need_a_master_addr():
    env = {**OMPI_ONE_NODE, "OMPI_COMM_WORLD_SIZE": "8"}
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        setup_mpi_env(env)
    env["MASTER_ADDR"] = "node0"
    assert setup_mpi_env(env) and env["WORLD_SIZE"] == "8"


def test_mpich_hydra():
    env = {"PMI_SIZE": "2", "PMI_RANK": "1"}
    assert setup_mpi_env(env)
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]) == ("2", "1", "1")


def test_no_launcher_changes_nothing():
    env = {"PATH": "/bin"}
    assert not setup_mpi_env(env)
    assert env == {"PATH": "/bin"}
