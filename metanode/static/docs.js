// Swagger UI over the node's own OpenAPI document (served from the swagger-ui-bundle package).
window.ui = SwaggerUIBundle({ url: "/openapi.json", dom_id: "#swagger-ui" });
