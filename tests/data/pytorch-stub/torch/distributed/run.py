"""A stand-in for torchrun (`python -m torch.distributed.run`) in kiln's
tests (CI has no PyTorch). As torchrun's agent does, it hosts a TCPStore at
MASTER_PORT (c10d's wire format, the queries kiln sends: VALIDATE, SET,
GET, WAIT), starts `--nproc-per-node` workers with torchrun's variables
(`TORCHELASTIC_USE_AGENT_STORE=True` among them) and exits with the first
failed worker's code. `--no-python` runs the command as it is, otherwise
the script under this Python. Flags: --nproc-per-node, --master-port
(default: a free port, as torchrun picks one), --no-python."""
import os
import socket
import struct
import subprocess
import sys
import threading

VALIDATE, SET, GET, WAIT = 0, 1, 3, 6
MAGIC = 0x3C85F7CE


def serve_store(listener):
    keys, changed = {}, threading.Condition()

    def read(conn, n):
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def u64(conn):
        return struct.unpack("<Q", read(conn, 8))[0]

    def client(conn):
        validated = False
        try:
            while True:
                query = read(conn, 1)[0]
                if query == VALIDATE:
                    validated = struct.unpack("<I", read(conn, 4))[0] == MAGIC
                    if not validated:
                        return
                elif not validated:
                    return
                elif query == SET:
                    key = read(conn, u64(conn))
                    value = read(conn, u64(conn))
                    with changed:
                        keys[key] = value
                        changed.notify_all()
                elif query == WAIT:
                    wanted = [read(conn, u64(conn)) for _ in range(u64(conn))]
                    with changed:
                        changed.wait_for(lambda: all(k in keys for k in wanted))
                    conn.sendall(b"\x00")
                elif query == GET:
                    key = read(conn, u64(conn))
                    with changed:
                        value = keys.get(key, b"")
                    conn.sendall(struct.pack("<Q", len(value)) + value)
                else:
                    return
        except (EOFError, OSError):
            return
        finally:
            conn.close()

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=client, args=(conn,), daemon=True).start()


def main():
    args = sys.argv[1:]
    nproc, port, no_python = 1, 0, False
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--no-python":
            no_python = True
        elif flag == "--nproc-per-node":
            nproc = int(args.pop(0))
        elif flag == "--master-port":
            port = int(args.pop(0))
        else:
            sys.exit(f"torchrun stub: {flag} is not a flag it knows")
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    port = listener.getsockname()[1]
    threading.Thread(target=serve_store, args=(listener,), daemon=True).start()
    command = args if no_python else [sys.executable, *args]
    workers = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "stub",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "OMP_NUM_THREADS": "1",
        })
        workers.append(subprocess.Popen(command, env=env))
    codes = [w.wait() for w in workers]
    sys.exit(next((c for c in codes if c != 0), 0))


main()
