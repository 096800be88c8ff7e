"""Letters between agents: the outbox and its couriers, the inbox, mailboxes that hold sealed
letters for peers that are away, groups, and asks answered by this node's agent.
May import core/, net/, door/ and models/.
"""
