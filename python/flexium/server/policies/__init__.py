"""The server's policies: what it does by itself for a team sharing GPU hosts, each a function
run inside one database transaction that decides and then acts only through the durable commands
that exist (``storage.create_commands``), audited under the policy's name (``PolicyActor``) with
its reason, which the job's timeline shows. Nothing runs beside the requests but the sweep: a
policy runs when what it decides on can change (``server/queue.py`` says when), and two servers on
one database never act twice on one job (each takes its host's lock before it counts the host's
room, the rows it acts on are read locked, and one active command per process is a unique index).

- ``resume_when_free``: the queue of paused jobs waiting for room.
- ``make_room``: pause the fewest jobs of lower priority on one GPU for a job, and hold the room.
- ``placement``: flexium run's jobs not started yet, placed where there is room (``server/placing.py``
  and ``server/queue.py`` run it).
- ``drain``: jobs moved off a drained GPU or host.
- ``waited_for``: who may take a GPU that a job earlier in the queue waits for (the one rule of
  passing, for waits and placements).
- ``room``: a host's GPUs as the policies count their room (reservations, resumes under way).
"""
