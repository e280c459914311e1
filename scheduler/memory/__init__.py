"""Memory admission: how much memory each tier may use, who holds it, and the one path every request for it
takes.

    sizing.py     start-up: the machine's limit, the host tier's budget, the device KV pool's size
    admission.py  MemoryAdmission, the ledger and its decisions: budgets, committed and held bytes, ceilings;
                  grants or refuses a plan whole (the one owner of the budgets while the server runs)
    service.py    MemoryService, the admission as one coroutine: every request for memory in arrival order,
                  planned at its turn; `register_budget`, the one way another engine part holds memory
    holders.py    BudgetHolder (what a holder gets) and MemoryUser (what it implements), and the room the
                  KV pool takes back from the holders before it parks a conversation
    requests.py   RequestMemory, the requests' side: admission, per-step reservation, preemption, release

The engine (scheduler/engine_build.py) is wired from these at start; the conversation cache's plans are what
the admission grants.
"""
