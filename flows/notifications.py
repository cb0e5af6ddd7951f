"""Install deploy/automations.yaml's notifications on a Prefect server: a webhook block and its automations.

    python -m flows.notifications --webhook URL [--block lmyard-notify] [--file deploy/automations.yaml]

A Prefect automation's send-notification action names its block by id, which a file cannot know: this creates
(or updates) the Custom Webhook block `--block` that POSTs {"subject", "body"} as JSON to URL, then creates each
automation of the file's `notifications:` list with that block's id, replacing an automation of the same name.
The server is PREFECT_API_URL's. Prints one line per automation.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

FILE = Path(__file__).resolve().parents[1] / "deploy" / "automations.yaml"


def webhook_block(url: str, name: str):
    """The Custom Webhook block `name` sending to `url` (saved, overwriting one of that name); its id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock(name=name, url=url, json_data={"subject": "{{subject}}", "body": "{{body}}"})
    return block.save(name, overwrite=True)


async def _install(entries: list[dict], block_id) -> list[tuple[str, str]]:
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    done = []
    async with get_client() as client:
        for entry in entries:
            for action in entry.get("actions", []):
                if action.get("type") == "send-notification":
                    action["block_document_id"] = str(block_id)
            automation = AutomationCore.model_validate(entry)
            for old in await client.read_automations_by_name(automation.name):
                await client.delete_automation(old.id)
            done.append((automation.name, str(await client.create_automation(automation))))
    return done


def install(url: str, block: str = "lmyard-notify", file: Path = FILE) -> list[tuple[str, str]]:
    """The block and the file's notifications on the server: [(automation name, id)]."""
    import yaml

    entries = (yaml.safe_load(file.read_text()) or {}).get("notifications") or []
    if not entries:
        raise SystemExit(f"{file} has no `notifications:` list")
    return asyncio.run(_install(entries, webhook_block(url, block)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.notifications", description=__doc__.splitlines()[0])
    p.add_argument("--webhook", required=True, metavar="URL", help="where notifications are POSTed")
    p.add_argument("--block", default="lmyard-notify", help="the webhook block's name")
    p.add_argument("--file", type=Path, default=FILE, help="the automations file (its `notifications:` list)")
    args = p.parse_args(argv)
    for name, automation_id in install(args.webhook, args.block, args.file):
        print(f"created automation {name} ({automation_id}) notifying through block {args.block}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
