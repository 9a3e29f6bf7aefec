"""The libraries assistants and agents are built with, pointed at a real `serve` on the
bundled model, each doing what its users rely on: LangChain's `ChatOpenAI` (invoke, stream,
structured output by JSON schema), pydantic-ai's typed output, instructor in tools mode, and
the OpenAI Agents SDK calling a function tool over chat completions."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.server_helpers import KEY, serving

pytestmark = pytest.mark.slow


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int


ASK = "Describe a person called Ada, who is 36."


@pytest.fixture
def base(make_backend):
    with serving(make_backend) as (url, _):
        yield f"{url}/v1"


def test_langchain_invokes_streams_and_gets_structured_output(base):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base, api_key=KEY, model="tiny", temperature=0, max_tokens=48)
    whole = llm.invoke("Name a river.")
    streamed = "".join(chunk.content for chunk in llm.stream("Name a river."))
    assert isinstance(whole.content, str) and whole.content and streamed == whole.content
    person = llm.with_structured_output(Person, method="json_schema").invoke(ASK)
    assert isinstance(person, Person)


def test_pydantic_ai_gets_a_typed_output(base):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=base, api_key=KEY))
    agent = Agent(model, output_type=Person, model_settings={"max_tokens": 96, "temperature": 0})
    assert isinstance(agent.run_sync(ASK).output, Person)


def test_instructor_in_tools_mode_gets_its_response_model(base):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base, api_key=KEY), mode=instructor.Mode.TOOLS)
    person = client.chat.completions.create(
        model="tiny",
        response_model=Person,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=96,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(person, Person)


def test_the_agents_sdk_calls_a_function_tool_over_chat_completions(base):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # it would send traces to OpenAI
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        asked.append(city)
        return f"Sunny in {city}."

    model = OpenAIChatCompletionsModel("tiny", AsyncOpenAI(base_url=base, api_key=KEY))
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather with the tool.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", max_tokens=128, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert asked and all(isinstance(city, str) for city in asked)
    assert result.final_output == f"Sunny in {asked[0]}."
